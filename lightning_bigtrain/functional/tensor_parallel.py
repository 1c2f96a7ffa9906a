"""Automatic tensor parallelism for any module, in Megatron-LM's layout, on DTensor.

The layout is Megatron-LM's (Shoeybi et al., 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", section 3): in each transformer block, the first linear of a pair is split by
output features ("column"), the second by input features ("row"), so the activation between them stays split
and one all-reduce per pair and pass restores the block's output. Attention's query/key/value projections are
column-split by heads and its output projection row-split; the token embedding and the LM head are split
along the vocabulary.

:func:`plan_tensor_parallel` finds the splits from the module's structure alone (no tracing, no data):

* *blocks* are the repeated children of a ``ModuleList`` / ``Sequential`` (as for sharding units);
* inside a block, an *attention* is a submodule with an integer head count (``n_head``, ``num_heads``, ...)
  holding two or more linears: the last is the output projection (row), the others its inputs (column),
  where an input ``k`` times as wide as the output projection's input is ``k`` packed projections (q/k/v);
* the other linears of the block pair up as an *MLP*: ``a`` then ``b`` with ``b.in == a.out`` and
  ``b.out == a.in`` (or ``a``, ``g`` then ``b`` for a gated MLP);
* outside the blocks, the vocabulary is the embedding with an LM head (a linear producing as many features, or
  sharing its weight; without one, the largest embedding), and that linear is the LM head;
* Hugging Face's ``Conv1D`` (weight stored in x out) counts as a linear; ``nn.MultiheadAttention`` inside blocks is
  first swapped for :class:`~lightning_bigtrain.functional.attention.HeadedAttention` by
  :func:`apply_tensor_parallel_` (its fused kernel reads the packed projection whole).

:func:`apply_tensor_parallel_` then splits them with ``torch.distributed.tensor.parallel``'s styles. Every
block class is first checked on fp32 copies: the split copy and the original must give the same output on the
same random input (a norm or a reshape the structure did not show would make them differ). A block class that
fails the check, or that the rules cannot split, stays replicated and is named in a warning; nothing is split on
a guess.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lightning_bigtrain.functional.sharding import divided_over, local_view, part_powers

__all__ = [
    "Split",
    "TensorParallelPlan",
    "apply_tensor_parallel_",
    "clip_grad_norm_global_",
    "finish_load",
    "grad_power_sum",
    "merged_shards",
    "plan_tensor_parallel",
    "saved_layout",
    "sharded_fraction",
    "split_grads_",
    "swap_block_attention_",
    "unpack_rows",
    "unpacked_shards",
]

_CONTAINERS = (nn.ModuleList, nn.Sequential)
_HEAD_ATTR = re.compile(r"^(n_?heads?|num_?heads|num_attention_heads|nhead|heads)$")
_WIDTH_ATTRS = ("split_size", "all_head_size", "inner_dim", "inner_size", "attn_dim")
SplitStyle = Literal["column", "row", "vocab_embedding", "vocab_head", "head_embedding"]


@dataclass(frozen=True)
class Split:
    """How one module is split: ``column`` (output features), ``row`` (input features), ``vocab_embedding`` (an
    embedding's rows), ``vocab_head`` (an LM head's output features, logits gathered) or ``head_embedding`` (an
    attention's table of one value per head, T5's relative position bias: its columns, each rank's heads, no
    collective). ``pack``: a column split's output holds that many projections side by side (q, k, v: 3), each split
    by heads."""

    style: SplitStyle
    pack: int = 1
    conv1d: bool = False  # Hugging Face's Conv1D: its weight is stored (in, out)


@dataclass
class TensorParallelPlan:
    """What :func:`plan_tensor_parallel` found. ``splits``: module name -> :class:`Split`; ``attributes``:
    module name -> {attribute: global value}, integers (head counts, widths) divided by the degree;
    ``blocks``: the blocks' names; ``replicated``: a block (or class) left whole -> why."""

    degree: int
    splits: dict[str, Split] = field(default_factory=dict)
    attributes: dict[str, dict[str, int]] = field(default_factory=dict)
    blocks: list[str] = field(default_factory=list)
    replicated: dict[str, str] = field(default_factory=dict)
    swapped_attention: list[str] = field(default_factory=list)  # nn.MultiheadAttention -> HeadedAttention
    # Sequence parallelism (Korthikanti et al., 2022): the blocks' norms (names) run on the activation split along
    # ``sequence_dim``; None: off (or refused: ``sequence_refused`` says why).
    sequence_dim: int | None = None
    norms: list[str] = field(default_factory=list)
    sequence_refused: str | None = None

    def packed(self) -> dict[str, tuple[int, int]]:
        """Parameter name -> (pack count, dimension of the packed outputs), for the packed column splits'
        parameters (their saved layout)."""
        return {
            f"{name}.{p}": (split.pack, int(split.conv1d and p == "weight"))
            for name, split in self.splits.items()
            if split.pack > 1
            for p in ("weight", "bias")
        }


def _is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's linears): ``x @ weight + bias`` with ``weight`` stored (in, out)."""
    weight = getattr(m, "weight", None)
    return type(m).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.ndim == 2


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or _is_conv1d(m)


def _features(m: nn.Module) -> tuple[int, int]:
    """(in, out) features of a linear or a ``Conv1D``."""
    if _is_conv1d(m):
        rows, cols = getattr(m, "weight").shape  # noqa: B009
        return int(rows), int(cols)
    assert isinstance(m, nn.Linear)
    return m.in_features, m.out_features


def _output_dim(m: nn.Module) -> int:
    """The weight's dimension that indexes output features."""
    return 1 if _is_conv1d(m) else 0


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated children of containers (outermost first; nested repeats inside a block are its own)."""
    found: list[tuple[str, nn.Module]] = []
    for name, parent in model.named_modules():
        if not isinstance(parent, _CONTAINERS) or any(name.startswith(f"{b}.") or name == b for b, _ in found):
            continue
        children = list(parent.named_children())
        counts = Counter(type(c) for _, c in children)
        for child_name, child in children:
            if counts[type(child)] >= 2 and any(_is_linear(m) for m in child.modules()):
                found.append((f"{name}.{child_name}" if name else child_name, child))
    return found


def _kind(block: nn.Module) -> tuple[Any, ...]:
    """Blocks planned and verified alike: one class with the same submodules. A class can differ by block: T5's
    decoder blocks add a cross-attention to its encoder's, and only each stack's first holds the position bias."""
    return (type(block), *((n, type(m)) for n, m in block.named_modules()))


def _head_attrs(module: nn.Module) -> dict[str, int]:
    return {
        k: v for k, v in vars(module).items() if isinstance(v, int) and not isinstance(v, bool) and _HEAD_ATTR.match(k)
    }


def _plan_block(block: nn.Module, degree: int) -> tuple[dict[str, Split], dict[str, dict[str, int]], str | None]:
    """Splits inside one block (names relative to it), attributes to divide, or why nothing splits."""
    splits: dict[str, Split] = {}
    attributes: dict[str, dict[str, int]] = {}
    in_attention: set[str] = set()
    notes: list[str] = []
    deepest_first = sorted(block.named_modules(), key=lambda item: -item[0].count(".") - bool(item[0]))
    linears = [(n, m) for n, m in block.named_modules() if _is_linear(m)]
    for name, module in deepest_first:
        heads = _head_attrs(module)
        head_dim = getattr(module, "head_dim", None)
        head_dim = head_dim if isinstance(head_dim, int) and not isinstance(head_dim, bool) and head_dim > 0 else None
        prefix = f"{name}." if name else ""
        own = [(prefix + n, m) for n, m in module.named_modules() if _is_linear(m)]
        if not (heads or head_dim) or len(own) < 2 or any(n in in_attention for n, _ in own):
            continue
        found = _attention_linears(own, linears, in_attention)
        if found is None:
            notes.append(f"{type(module).__name__}: projections of unexpected shapes")
            continue
        inputs, (out_name, out) = found
        inner, width = _features(out)
        # The head count: an attribute (divided on the split module), or the width over `head_dim` (Hugging Face's
        # newer attention, which reshapes to (-1, head_dim) and needs no attribute changed).
        count = next(iter(heads.values())) if heads else inner // head_dim  # type: ignore[operator]
        size = head_dim or (inner // count if count and inner % count == 0 else 0)
        packs = [_pack(_features(m)[1], inner, size, degree) for _, m in inputs]
        if not size or any(_features(m)[0] != width for _, m in inputs) or 0 in packs or sum(packs) < 2:
            notes.append(f"{type(module).__name__}: projections of unexpected shapes")
            continue
        if count % degree or inner % degree:
            notes.append(f"{type(module).__name__}: {count} heads not divisible by {degree}")
            continue
        for (n, m), pack in zip(inputs, packs, strict=True):
            splits[n] = Split("column", pack, _is_conv1d(m))
        splits[out_name] = Split("row", conv1d=_is_conv1d(out))
        for n, m in module.named_modules():  # a per-head table (T5's relative position bias): each rank its heads
            if isinstance(m, nn.Embedding) and m.embedding_dim == count:
                splits[prefix + n] = Split("head_embedding")
        divide = dict(heads)
        divide.update({k: v for k in _WIDTH_ATTRS if isinstance(v := getattr(module, k, None), int) and v == inner})
        if divide:
            attributes[name] = divide
        in_attention.update(n for n, _ in [*inputs, (out_name, out)])
    rest = [(n, _features(m)) for n, m in block.named_modules() if _is_linear(m) and n not in in_attention]
    conv1d = {n: _is_conv1d(m) for n, m in block.named_modules()}
    i = 0
    while i < len(rest):
        (na, a), nxt = rest[i], rest[i + 1 : i + 3]
        if len(nxt) == 2 and nxt[0][1] == a and nxt[1][1] == (a[1], a[0]) and a[1] % degree == 0:
            # gated MLP: a (gate) and g (up) column, then b (down) row
            splits[na] = splits[nxt[0][0]] = Split("column", conv1d=conv1d[na])
            splits[nxt[1][0]] = Split("row", conv1d=conv1d[nxt[1][0]])
            i += 3
        elif nxt and nxt[0][1] == (a[1], a[0]) and a[1] % degree == 0:
            splits[na], splits[nxt[0][0]] = Split("column", conv1d=conv1d[na]), Split("row", conv1d=conv1d[nxt[0][0]])
            i += 2
        else:
            i += 1
    if not splits:
        return {}, {}, "; ".join(notes) or "no attention or MLP linears found"
    return splits, attributes, None


#: Names of an attention's value projection: the last of an attention module's linears is its output projection
#: unless it is one of these, and then the output projection follows the module (BERT's ``BertSelfOutput.dense``).
_VALUE_NAMES = frozenset({"v", "value", "v_proj", "value_proj", "to_v", "wv"})


def _attention_linears(
    own: list[tuple[str, nn.Module]], linears: list[tuple[str, nn.Module]], taken: set[str]
) -> tuple[list[tuple[str, nn.Module]], tuple[str, nn.Module]] | None:
    """An attention's input projections and its output projection, from its own linears (block-relative names) and
    the block's: the last own linear is the output, unless it is named as a value projection; then the output is the
    block's next linear after them that takes the projections' width. None when there is no such linear. A wrong
    pairing cannot pass: every split block class is verified on a copy."""
    last = own[-1][0].rsplit(".", 1)[-1]
    if last not in _VALUE_NAMES:
        return own[:-1], own[-1]
    names = [n for n, _ in linears]
    after = linears[names.index(own[-1][0]) + 1 :]
    width = _features(own[-1][1])[1]
    nxt = next(((n, m) for n, m in after if n not in taken), None)
    if nxt is None or _features(nxt[1])[0] != width:
        return None
    return own, nxt


def _pack(out: int, inner: int, head_dim: int, degree: int) -> int:
    """How many projections a column split's output packs: ``out / inner`` (q, k, v side by side: 3), or 1 for a
    grouped-query attention's key or value projection (fewer heads than the queries, a multiple of the degree); 0
    when neither fits."""
    if out % inner == 0:
        return out // inner
    if out < inner and out % head_dim == 0 and (out // head_dim) % degree == 0:
        return 1
    return 0


def plan_tensor_parallel(model: nn.Module, degree: int) -> TensorParallelPlan:
    """Find the Megatron-style splits of ``model`` for tensor-parallel degree ``degree`` (structure only).

    Returns a :class:`TensorParallelPlan`; nothing is changed. Names are ``model.named_modules()``'s."""
    if not isinstance(degree, int) or degree < 1:
        raise ValueError(f"`tensor_parallel={degree!r}`: must be an integer >= 1.")
    plan = TensorParallelPlan(degree)
    if degree == 1:
        return plan
    blocks = _blocks(model)
    by_class: dict[tuple[Any, ...], tuple[dict[str, Split], dict[str, dict[str, int]], str | None]] = {}
    for name, block in blocks:
        kind = _kind(block)
        if kind not in by_class:
            by_class[kind] = _plan_block(block, degree)
        splits, attributes, why = by_class[kind]
        plan.blocks.append(name)
        if why is not None:
            plan.replicated[name] = why
            continue
        plan.splits.update({f"{name}.{k}": v for k, v in splits.items()})
        plan.attributes.update({f"{name}.{k}" if k else name: dict(v) for k, v in attributes.items()})
    inside = tuple(f"{name}." for name, _ in blocks)
    embeddings = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and not n.startswith(inside)]
    # The vocabulary: an embedding with an LM head (a linear outside the blocks producing as many features, or
    # sharing its weight); without one, the largest embedding (position tables are rarely the largest).
    with_head = [
        (n, e)
        for n, e in embeddings
        if any(
            isinstance(m, nn.Linear)
            and not hn.startswith(inside)
            and (m.out_features == e.num_embeddings or m.weight is e.weight)
            for hn, m in model.named_modules()
        )
    ]
    if with_head or embeddings:
        name, emb = max(with_head or embeddings, key=lambda e: e[1].num_embeddings)
        vocab = emb.num_embeddings
        heads = [
            (n, m)
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not n.startswith(inside) and m.out_features == vocab
        ]
        if vocab % degree:
            plan.replicated[name] = f"vocabulary of {vocab} not divisible by {degree}"
        else:
            plan.splits[name] = Split("vocab_embedding")
            for n, e in embeddings:  # modules sharing its table (T5's encoder and decoder `embed_tokens`)
                if n != name and e.weight is emb.weight:
                    plan.splits[n] = Split("vocab_embedding")
            for n, _ in heads:
                plan.splits[n] = Split("vocab_head")
    return plan


def _get(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name) if name else model


def _pack_rows_(module: nn.Module, pack: int, degree: int) -> None:
    """Reorder a packed projection's outputs so that contiguous slice ``r`` of ``degree`` holds rank r's
    heads of every packed projection: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` instead of ``[q | k | v]``."""
    with torch.no_grad():
        for pname in ("weight", "bias"):
            p = getattr(module, pname, None)
            if p is None:
                continue
            dim = _output_dim(module) if pname == "weight" else 0
            q = p.movedim(dim, 0)
            reordered = q.reshape(pack, degree, q.shape[0] // (pack * degree), *q.shape[1:]).transpose(0, 1)
            p.copy_(reordered.reshape(q.shape).movedim(0, dim))


@functools.cache
def _conv1d_style_class(column: bool) -> Any:
    """ColwiseParallel / RowwiseParallel for Hugging Face's ``Conv1D``, whose weight is stored (in, out): a column
    split cuts the weight's dimension 1 and the bias, a row split the weight's dimension 0 (bias replicated)."""
    from functools import partial

    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    base = ColwiseParallel if column else RowwiseParallel
    placements = {"weight": Shard(1), "bias": Shard(0)} if column else {"weight": Shard(0), "bias": Replicate()}

    class Conv1DStyle(base):  # type: ignore[misc,valid-type]
        def _partition_conv1d(self, name: str, module: nn.Module, mesh: Any) -> None:
            for pname, placement in placements.items():
                p = getattr(module, pname, None)
                if p is not None:
                    value = distribute_tensor(p, mesh, [placement], src_data_rank=self.src_data_rank)
                    module.register_parameter(pname, nn.Parameter(value, requires_grad=p.requires_grad))

        def _apply(self, module: nn.Module, mesh: Any) -> nn.Module:
            # The input a row split computes on is split along its last dimension; a column split's is whole.
            desired = (Replicate(),) if column else (Shard(-1),)
            return distribute_module(
                module,
                mesh,
                self._partition_conv1d,
                partial(self._prepare_input_fn, self.input_layouts, desired),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            )

    return Conv1DStyle


def _apply_splits(
    root: nn.Module,
    splits: dict[str, Split],
    attributes: dict[str, dict[str, int]],
    mesh,
    norms: Iterable[str] = (),
    sequence_dim: int | None = None,
) -> None:
    """Split ``root``'s modules named in ``splits``; with ``sequence_dim``, the blocks' column splits take their input
    split along that dimension (gathered first), their row splits leave their output split along it
    (reduce-scattered instead of all-reduced), and the ``norms`` run on the split activation."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    degree = mesh.size()
    column_kw: dict[str, Any] = {} if sequence_dim is None else {"input_layouts": Shard(sequence_dim)}
    row_kw: dict[str, Any] = (
        {} if sequence_dim is None else {"output_layouts": Shard(sequence_dim), "use_local_output": False}
    )
    styles: dict[str, ParallelStyle] = {}
    for name, split in splits.items():
        module = _get(root, name)
        if split.style == "column":
            if split.pack > 1:
                _pack_rows_(module, split.pack, degree)
            styles[name] = _conv1d_style_class(True)(**column_kw) if split.conv1d else ColwiseParallel(**column_kw)
        elif split.style == "row":
            styles[name] = _conv1d_style_class(False)(**row_kw) if split.conv1d else RowwiseParallel(**row_kw)
        elif split.style == "vocab_embedding":
            styles[name] = RowwiseParallel(input_layouts=Replicate())
        elif split.style == "head_embedding":
            styles[name] = ColwiseParallel()  # indices whole on every rank; this rank's heads out, locally
        else:
            styles[name] = ColwiseParallel(output_layouts=Replicate())
    if sequence_dim is not None:
        for name in norms:
            styles[name] = SequenceParallel(sequence_dim=sequence_dim, use_local_output=False)
    ties = _ties(root, list(styles))
    parallelize_module(root, mesh, styles)
    for holders in ties:  # one parameter again: every holder of a tied tensor holds the first split module's
        (owner, attr), rest = holders[0], holders[1:]
        for module, name in rest:
            setattr(module, name, getattr(owner, attr))
    for name, attrs in attributes.items():
        module = _get(root, name)
        for attr, value in attrs.items():
            setattr(module, attr, value // degree)


def _ties(root: nn.Module, split: list[str]) -> list[list[tuple[nn.Module, str]]]:
    """Parameters a split module shares with other modules (an LM head tied to the embedding, T5's encoder and decoder
    `embed_tokens`, BERT's `cls.predictions.bias` and its decoder's bias), each as its holders ``(module, attribute)``,
    a split module first. Splitting replaces a module's parameter with a new DTensor: without re-tying, the other
    holders keep the old tensor, which then trains apart (or not at all) and is saved stale."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for attr, param in module.named_parameters(recurse=False):
            holders.setdefault(id(param), []).append((module, attr))
    first = {id(_get(root, name)): i for i, name in enumerate(split)}
    groups = []
    for group in holders.values():
        ranked = sorted(group, key=lambda h: first.get(id(h[0]), len(first)))
        if len(group) > 1 and id(ranked[0][0]) in first:
            groups.append(ranked)
    return groups


def _verifiable_copy(block: nn.Module, mesh: Any) -> nn.Module:
    """A copy of a meta-device ``block`` on the mesh's device, with the same values on every rank: as
    :func:`~lightning_bigtrain.functional.materialize.materialize_` initializes it from its records under a fixed
    seed (buffers such as masks and position indices as the model computes them), what stays unwritten drawn from
    a fixed normal. One block whole, for the check only."""
    from lightning_bigtrain.functional.materialize import init_records, materialize_

    device = torch.device(mesh.device_type)
    if device.type != "cpu":
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    records = init_records(block)  # (read from the block's own tensors: a deep copy drops a parameter's)
    trial = copy.deepcopy(block)
    materialize_(trial, device, records, seed=1234)
    generator = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for t in itertools.chain(trial.parameters(), trial.buffers()):
            if t.is_floating_point() and bool(torch.isnan(t).any()):
                t.copy_(torch.randn(t.shape, generator=generator) * 0.02)
    return trial


def _verify_block(
    block: nn.Module, splits, attributes, mesh, width: int, norms: Iterable[str] = (), sequence_dim: int | None = None
) -> str | None:
    """Split a copy of ``block`` and compare it with the original on one random input; None when equal. With
    ``sequence_dim`` the copy runs sequence-parallel: its input split along that dimension, its output gathered."""
    if next(block.parameters()).is_meta:  # a model built on meta, split before it is materialized
        block = _verifiable_copy(block, mesh)
    device = next(block.parameters()).device
    # Both in fp32 (a 16-bit block's round-off would hide nothing a wrong split changes, but would fail the check).
    reference, trial = copy.deepcopy(block).float().eval(), copy.deepcopy(block).float().eval()
    generator = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(2, 8, width, generator=generator).to(device=device)
    why = None
    # Every required positional input gets the same tensor (a decoder layer's memory: cross-attention on x).
    args = [x] * max(1, _required_inputs(block))
    kwargs = _rotary_inputs(block, x, generator)
    out = None
    if _takes(block, "encoder_hidden_states"):  # a Hugging Face decoder block's cross-attention runs too
        try:
            with torch.no_grad():
                out = reference(*args, **kwargs, encoder_hidden_states=x)
            kwargs["encoder_hidden_states"] = x
        except Exception:  # a block without cross-attention may refuse the argument (GPT-2's does)
            pass
    try:
        with torch.no_grad():
            expected = _first_tensor(out if out is not None else reference(*args, **kwargs))
            _apply_splits(trial, splits, attributes, mesh, norms, sequence_dim)
            if sequence_dim is not None:
                args = [_enter_sequence(a, mesh, sequence_dim) for a in args]
            got = _whole(_first_tensor(trial(*args, **kwargs)), mesh)
        if got.shape != expected.shape:
            why = f"split output has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
        else:
            err = (got.float() - expected.float()).abs().max().item()
            scale = expected.float().abs().max().item() + 1e-6
            if err > 1e-4 * scale + 1e-6:
                why = f"split output differs from the original (max error {err:.2e})"
    except Exception as error:  # a forward that cannot take the split copy: replicated, with the reason
        why = f"split copy failed to run ({type(error).__name__}: {error})"
    del reference, trial
    # Every rank of the group must reach the same verdict.
    flag = torch.tensor([0.0 if why is None else 1.0], device=device)
    torch.distributed.all_reduce(flag, group=mesh.get_group())
    if flag.item() and why is None:
        why = "split output differs from the original on another rank"
    return why


def _enter_sequence(x: torch.Tensor, mesh: Any, dim: int) -> torch.Tensor:
    """The whole activation every rank of the group holds, as this rank's piece along ``dim`` (no message; its
    gradient is gathered in backward)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(dim)])


def _whole(x: torch.Tensor, mesh: Any) -> torch.Tensor:
    """A sequence-split activation gathered whole on every rank of the group (a plain tensor)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(x, DTensor):
        return x.redistribute(mesh, [Replicate()]).to_local()
    return x


def _norms(block: nn.Module, splits: dict[str, Split]) -> list[str]:
    """The block's normalization layers (a class named ``*Norm``, ``LayerNorm``/``RMSNorm``/``GroupNorm``...), by name
    relative to the block; those inside a split linear's subtree excepted (none in practice)."""
    return [
        n
        for n, m in block.named_modules()
        if n and type(m).__name__.endswith("Norm") and not any(n.startswith(f"{k}.") for k in splits)
    ]


def _install_sequence_boundaries(model: nn.Module, blocks: list[str], mesh: Any, dim: int) -> None:
    """Split the activation along ``dim`` where it enters each container's first block and gather it where it leaves
    the container's last (blocks in between pass it on split)."""

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args and isinstance(args[0], torch.Tensor):
            return (_enter_sequence(args[0], mesh, dim), *args[1:]), kwargs
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            return args, {**kwargs, "hidden_states": _enter_sequence(kwargs["hidden_states"], mesh, dim)}
        return None

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return _whole(output, mesh)
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            return type(output)([_whole(output[0], mesh), *output[1:]])
        return output

    containers: dict[str, list[str]] = {}
    for name in blocks:  # each container's run of blocks (an encoder's and a decoder's separately)
        containers.setdefault(name.rpartition(".")[0], []).append(name)
    for run in containers.values():
        _get(model, run[0]).register_forward_pre_hook(enter, with_kwargs=True)
        _get(model, run[-1]).register_forward_hook(leave)


def _takes(block: nn.Module, argument: str) -> bool:
    import inspect

    try:
        return argument in inspect.signature(block.forward).parameters
    except (TypeError, ValueError):
        return False


def _rotary_inputs(block: nn.Module, x: torch.Tensor, generator: torch.Generator) -> dict[str, Any]:
    """A block that takes its rotary position angles from the model (Hugging Face's Llama family:
    ``position_embeddings=(cos, sin)``, each (batch, sequence, head_dim)) gets a pair made from random angles, the same
    for the original and the split copy (the check compares the two, not the model's positions). Sequence-parallel
    too they arrive whole, as the model computes them outside the blocks: the attention's projections gather the
    sequence before the angles are applied."""
    dims = [getattr(m, "head_dim", None) for m in block.modules()]
    head_dim = next((d for d in dims if isinstance(d, int) and not isinstance(d, bool)), None)
    if head_dim is None or not _takes(block, "position_embeddings"):
        return {}
    angles = torch.rand((x.shape[0], x.shape[1], head_dim), generator=generator).to(x.device) * (2 * math.pi)
    return {"position_embeddings": (angles.cos(), angles.sin())}


def _required_inputs(block: nn.Module) -> int:
    """How many positional inputs ``block.forward`` requires (without defaults)."""
    import inspect

    try:
        parameters = inspect.signature(block.forward).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in kinds and p.default is inspect.Parameter.empty)


def _first_tensor(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"block returned {type(out).__name__}, not a tensor")


def _block_width(block: nn.Module, splits: dict[str, Split]) -> int:
    name = next(n for n, s in splits.items() if s.style == "column")
    return _features(block.get_submodule(name))[0]


def swap_block_attention_(model: nn.Module) -> list[str]:
    """The repeated blocks' ``nn.MultiheadAttention`` replaced by the equivalent
    :class:`~lightning_bigtrain.functional.attention.HeadedAttention`, in place; returns their names.
    ``nn.MultiheadAttention`` packs q/k/v in one raw parameter its fused kernel reads whole; ``HeadedAttention``
    computes the same function with one linear per projection, which splits by heads. On the meta device the new
    projections' values are recorded as slices of the packed one (for
    :func:`~lightning_bigtrain.functional.materialize.materialize_`)."""
    from lightning_bigtrain.functional.attention import swap_multihead_attention_

    inside = [f"{name}." for name, _ in _blocks(model)]
    names = [n for n, m in model.named_modules() if type(m) is nn.MultiheadAttention and n.startswith(tuple(inside))]
    return swap_multihead_attention_(model, names) if names else []


def apply_tensor_parallel_(
    model: nn.Module,
    mesh,
    plan: TensorParallelPlan | None = None,
    verify: bool = True,
    sequence_parallel: bool = False,
    swapped: list[str] | None = None,
) -> TensorParallelPlan:
    """Split ``model`` in place over the 1-D ``mesh`` (its tensor-parallel group) and return the plan applied.

    The blocks' ``nn.MultiheadAttention`` become :class:`~lightning_bigtrain.functional.attention.HeadedAttention`
    first (:func:`swap_block_attention_`); ``swapped`` names those a caller swapped already (recorded in the plan).

    Parameters that stay whole are made identical on every rank of the group (rank 0's values), as the split
    ones are (``distribute_tensor`` takes rank 0's). With ``verify``, each block class is checked on a copy
    first (see the module's docstring); a class that fails stays replicated and ``plan.replicated`` says why.

    ``sequence_parallel`` (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
    Models", section 4.2.2): between the blocks' split regions the activation stays split along its second dimension
    (the sequence for batch-first blocks; any per-token dimension serves, as norms, dropout and residual additions
    act per token), so what those layers save for backward is divided by the degree; each all-reduce becomes a
    reduce-scatter and the input of each column split is all-gathered. Every block class is verified so; if one
    fails, or some block stays whole, the model runs without it and ``plan.sequence_refused`` says why."""
    degree = mesh.size()
    if plan is None and degree > 1:
        swapped = list(swapped or []) + swap_block_attention_(model)
    plan = plan if plan is not None else plan_tensor_parallel(model, degree)
    plan.swapped_attention = list(swapped or [])
    if plan.degree != degree:
        raise ValueError(f"plan for degree {plan.degree} applied on a mesh of {degree} ranks")
    group = mesh.get_group()
    src = torch.distributed.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.device.type != "meta" and not hasattr(tensor, "placements"):
                torch.distributed.broadcast(tensor, src=src, group=group)
    if verify and degree > 1:
        checked: dict[tuple[Any, ...], str | None] = {}
        for name in plan.blocks:
            if name in plan.replicated:
                continue
            block = _get(model, name)
            kind = _kind(block)
            if kind not in checked:
                local = _relative(plan, name)
                checked[kind] = _verify_block(block, *local, mesh, _block_width(block, local[0]))
            why = checked[kind]
            if why is not None:
                plan.replicated[name] = why
                for key in [k for k in plan.splits if k.startswith(f"{name}.")]:
                    del plan.splits[key]
                for key in [k for k in plan.attributes if k == name or k.startswith(f"{name}.")]:
                    del plan.attributes[key]
    if sequence_parallel and degree > 1:
        _plan_sequence(model, plan, mesh, verify)
    _apply_splits(model, plan.splits, plan.attributes, mesh, plan.norms, plan.sequence_dim)
    if plan.sequence_dim is not None:
        _install_sequence_boundaries(model, plan.blocks, mesh, plan.sequence_dim)
    return plan


def _plan_sequence(model: nn.Module, plan: TensorParallelPlan, mesh: Any, verify: bool) -> None:
    """Turn sequence parallelism on in ``plan`` when every block is split and every block class passes the check
    sequence-parallel (else ``plan.sequence_refused`` says why)."""
    dim = 1
    whole = [n for n in plan.blocks if n in plan.replicated]
    if not plan.blocks or whole:
        plan.sequence_refused = (
            f"blocks left whole ({', '.join(whole)}) would receive the split activation" if whole else "no blocks"
        )
        return
    checked: dict[tuple[Any, ...], str | None] = {}
    norms: list[str] = []
    for name in plan.blocks:
        block = _get(model, name)
        if _required_inputs(block) > 1:  # a decoder layer's memory arrives whole: its projections would take it split
            plan.sequence_refused = f"{type(block).__name__} takes a second input (cross-attention memory)"
            return
        splits, attributes = _relative(plan, name)
        own = _norms(block, splits)
        kind = _kind(block)
        if verify and kind not in checked:
            width = _block_width(block, splits)
            checked[kind] = _verify_block(block, splits, attributes, mesh, width, own, dim)
        why = checked.get(kind)
        if why is not None:
            plan.sequence_refused = f"{type(block).__name__}: {why}"
            return
        norms += [f"{name}.{n}" for n in own]
    plan.sequence_dim, plan.norms = dim, norms


def split_grads_(model: nn.Module) -> None:
    """Hold each split parameter's gradient split as the parameter is; call after backward. DTensor computes some
    gradients whole on every rank (a vocabulary-split embedding's: its output gradient is replicated); taking this
    rank's slice of a replicated gradient sends nothing and frees the rest. (Not a gradient hook: moving a module
    with ``.to()`` swaps a DTensor parameter's tensor and its hooks stop firing.)"""
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        grad, placements = param.grad, getattr(param, "placements", None)
        if grad is None or placements is None or getattr(grad, "placements", placements) == placements:
            continue
        local = local_view(grad.redistribute(placements=placements))  # type: ignore[attr-defined]
        # The slice is a view of the whole gradient: copy it so that the whole one is freed.
        mesh = getattr(param, "device_mesh")  # noqa: B009 (a DTensor's)
        param.grad = DTensor.from_local(local.clone(), mesh, placements, run_check=False, shape=param.shape,
                                        stride=param.stride())  # fmt: skip


def _relative(plan: TensorParallelPlan, block: str) -> tuple[dict[str, Split], dict[str, dict[str, int]]]:
    prefix = f"{block}."
    splits = {k[len(prefix) :]: v for k, v in plan.splits.items() if k.startswith(prefix)}
    attributes = {
        ("" if k == block else k[len(prefix) :]): v
        for k, v in plan.attributes.items()
        if k == block or k.startswith(prefix)
    }
    return splits, attributes


def sharded_fraction(model: nn.Module, plan: TensorParallelPlan) -> float:
    """Fraction of the blocks' parameters (counted at full size) that the plan splits."""
    total = split = 0
    for name in plan.blocks:
        block = _get(model, name)
        for mname, module in block.named_modules():
            full = f"{name}.{mname}" if mname else name
            n = sum(_full_numel(p) for p in module.parameters(recurse=False))
            total += n
            split += n if full in plan.splits else 0
    return split / total if total else 0.0


def _full_numel(p: torch.Tensor) -> int:
    return int(torch.Size(p.shape).numel())


def clip_grad_norm_global_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by their global norm where some are DTensors (split, or sharded) and some plain tensors
    (whole on every rank). Each DTensor contributes its local shard's ``p``-th power sum, summed over the ranks
    of every mesh dimension it is sharded on; a replicated one (and a plain tensor) counts once."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm = grad_power_sum(grads, norm_type) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        local = local_view(g)
        local.mul_(coef.to(local.dtype))
    return norm


def grad_power_sum(grads: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The sum of the ``norm_type``-th powers of ``grads`` over every rank that holds a part of them: each DTensor's
    local power sum summed over the mesh dimensions it is divided on, a replicated one (or a plain tensor) once
    (:func:`~lightning_bigtrain.functional.sharding.part_powers`). A collective over those mesh dimensions: every
    rank of them must call it with the same kinds of tensors."""
    grads = list(grads)
    if norm_type == float("inf"):
        raise ValueError(
            "gradient_clip_algorithm='norm' with an infinite norm is not supported with tensor parallelism"
        )
    if not grads:
        return torch.zeros(())
    # (Gradients are never Partial here: any placement but Replicate divides the tensor over that mesh dimension.)
    return part_powers([(local_view(g), divided_over(g)) for g in grads], norm_type).sum()


def unpack_rows(full: torch.Tensor, pack: int, degree: int, dim: int = 0) -> torch.Tensor:
    """A whole packed projection's tensor back in its own order (``[q | k | v]`` along ``dim``), from the split
    order ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` that ``degree`` ranks hold it in (inverse of the split's reorder)."""
    q = full.movedim(dim, 0)
    unpacked = q.reshape(degree, pack, q.shape[0] // (pack * degree), *q.shape[1:]).transpose(0, 1)
    return unpacked.reshape(q.shape).movedim(0, dim)


def _unpacked_segments(start: int, count: int, width: int, pack: int, degree: int) -> list[tuple[int, int, int]]:
    """Split-order indices ``[start, start + count)`` as ``(local offset, unpacked index, length)`` runs."""
    block = width // degree  # one rank's share of one packed projection
    per_rank = pack * block
    runs = []
    offset = 0
    while offset < count:
        rank, rem = divmod(start + offset, per_rank)
        j, i = divmod(rem, block)
        length = min(block - i, count - offset)
        runs.append((offset, j * width + rank * block + i, length))
        offset += length
    return runs


def _owned_local(tensor: torch.Tensor) -> tuple[torch.Tensor, list[int], bool]:
    """A DTensor's local tensor, its offset in the global tensor, and whether this rank gives it to a checkpoint (a
    copy that other ranks also hold, replicated over a mesh dimension, is given by coordinate 0 only)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = getattr(tensor, "device_mesh")  # noqa: B009 (a DTensor's)
    placements = getattr(tensor, "placements")  # noqa: B009
    _, offset = compute_local_shape_and_global_offset(torch.Size(tensor.shape), mesh, placements)
    coordinate = mesh.get_coordinate() or []
    owner = all(c == 0 for c, pl in zip(coordinate, placements, strict=True) if pl.is_replicate())
    return local_view(tensor), list(offset), owner


def _sharded(pieces: list[tuple[torch.Tensor, list[int]]], shape: tuple[int, ...], group: Any = None) -> torch.Tensor:
    """A ``ShardedTensor`` of global ``shape`` from this rank's ``(view, offsets)`` pieces. Collective over ``group``
    (the ranks holding the tensor; None: every rank)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    rank = torch.distributed.get_rank()
    shards = [
        Shard(
            view, ShardMetadata(shard_offsets=at, shard_sizes=list(view.shape), placement=f"rank:{rank}/{view.device}")
        )
        for view, at in pieces
    ]
    return init_from_local_shards(shards, *shape, process_group=group)


def unpacked_shards(tensor: torch.Tensor, pack: int, degree: int, dim: int = 0, group: Any = None) -> torch.Tensor:
    """This rank's part of a split packed projection (a DTensor), addressed in the projection's own order.

    Returns a ``ShardedTensor`` whose local shards are *views* of the DTensor's local tensor, one per
    contiguous run along ``dim``: ``torch.distributed.checkpoint`` saves it as the unsplit tensor would be
    saved (so the checkpoint loads at any layout, or on one device) and loads into it in place. Collective."""
    shape = tuple(tensor.shape)
    local, offset, owner = _owned_local(tensor)
    pieces = []
    if owner and local.numel():
        for at, index, length in _unpacked_segments(offset[dim], local.shape[dim], shape[dim] // pack, pack, degree):
            pieces.append((local.narrow(dim, at, length), [index if d == dim else o for d, o in enumerate(offset)]))
    return _sharded(pieces, shape, group)


def merged_shards(tensors: list[torch.Tensor], group: Any = None) -> torch.Tensor:
    """DTensors split (or sharded) along dimension 0, as one tensor concatenated along it (each after the previous
    ones): a ``ShardedTensor`` whose local shards are views of the DTensors' local tensors (saved as the
    concatenation would be; loaded into in place). Collective."""
    pieces, base = [], 0
    for tensor in tensors:
        local, offset, owner = _owned_local(tensor)
        if owner and local.numel():
            pieces.append((local, [base + offset[0], *offset[1:]]))
        base += tensor.shape[0]
    return _sharded(pieces, (base, *tensors[0].shape[1:]), group)


def saved_layout(
    state: dict,
    packed: dict[str, tuple[int, int]],
    degree: int,
    merged: dict[str, list[str]] | None = None,
    group: Any = None,
) -> dict:
    """A model or optimizer state dict (fully qualified names) in the layout of the module as written: each split
    packed projection's tensors in the projection's own order (whole tensors reordered by :func:`unpack_rows`,
    DTensors as :func:`unpacked_shards` views); and, for ``merged`` (``{name: [source names]}``, e.g. a swapped
    ``nn.MultiheadAttention``'s ``in_proj_weight`` from its q/k/v projections), the sources as one entry (whole
    tensors concatenated, DTensors as :func:`merged_shards` views). Other entries pass through. ``group``: the ranks
    holding these tensors (a pipeline stage's; None: every rank), over which the views' metadata is gathered."""
    merged = merged or {}
    sources = {src for names in merged.values() for src in names}

    def convert(value: object, name: str) -> object:
        if not isinstance(value, torch.Tensor) or value.ndim == 0:
            return value
        pack, dim = packed[name]
        if hasattr(value, "placements"):
            return unpacked_shards(value, pack, degree, dim, group)
        return unpack_rows(value, pack, degree, dim)

    def join(values: list[object]) -> object:
        first = values[0]
        if not isinstance(first, torch.Tensor) or first.ndim == 0:
            return first  # e.g. the optimizer's step count: the same for every source
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        return merged_shards(tensors, group) if hasattr(first, "placements") else torch.cat(tensors)

    if isinstance(state.get("state"), dict) and "param_groups" in state:  # an optimizer's
        per_param = {
            name: ({k: convert(v, name) for k, v in entry.items()} if name in packed else entry)
            for name, entry in state["state"].items()
            if name not in sources
        }
        for name, names in merged.items():
            entries = [state["state"][n] for n in names if n in state["state"]]
            if len(entries) == len(names):
                per_param[name] = {k: join([e[k] for e in entries]) for k in entries[0]}
        groups = []
        for group in state["param_groups"]:
            params: list[str] = []
            for n in group["params"]:
                target = next((t for t, names in merged.items() if n in names), None)
                if target is None:
                    params.append(n)
                elif target not in params:
                    params.append(target)
            groups.append({**group, "params": params})
        return {**state, "state": per_param, "param_groups": groups}
    out = {
        name: convert(value, name) if name in packed else value for name, value in state.items() if name not in sources
    }
    for name, names in merged.items():
        if all(n in state for n in names):
            out[name] = join([state[n] for n in names])
    return out


def finish_load(loaded: dict, state: dict, merged: dict[str, list[str]]) -> None:
    """After ``torch.distributed.checkpoint.load`` into :func:`saved_layout`'s dict ``loaded``, complete ``state``
    (the dict it was made from): tensors loaded through views are in place already; an optimizer's param-group
    values (learning rate, betas, ...) are copied back; and each merged entry that was a whole tensor is split back
    into its sources (a scalar, such as the optimizer's step, is given to every source)."""
    if isinstance(state.get("state"), dict) and "param_groups" in state:  # an optimizer's
        for group, new in zip(state["param_groups"], loaded["param_groups"], strict=True):
            group.update({k: v for k, v in new.items() if k != "params"})
        for name, names in merged.items():
            for key, value in loaded["state"].get(name, {}).items():
                targets = [state["state"][n][key] for n in names if key in state["state"].get(n, {})]
                if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
                    if value.ndim == 0:
                        for t in targets:
                            if t is not value:
                                t.copy_(value)
                    else:
                        _split_into(value, targets)
        return
    for name, names in merged.items():
        value = loaded.get(name)
        if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
            _split_into(value, [state[n] for n in names])


def _split_into(value: torch.Tensor, targets: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for target, part in zip(targets, value.split([t.shape[0] for t in targets]), strict=True):
            target.copy_(part)
