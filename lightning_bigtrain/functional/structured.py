"""Structured pruning: find which channels of a model are coupled, score them, and remove them physically.

A *channel group* is a set of channels that must be removed together for the model to stay consistent: the
output channels of a convolution or linear layer (its *producer*), the input slices of every layer that reads
them (*consumers*, also through pooling, flattening and concatenation), the BatchNorm that normalizes them,
and every other producer joined to them by a residual addition. Groups are found by tracing the model with
``torch.fx`` on an example input and following each tensor's channel dimension through the graph.

Anything the tracer cannot follow makes the groups it touches *blocked* (never pruned) with the reason
recorded, so removal is safe by construction: operations whose output at a zero channel is not zero
(sigmoid, LayerNorm's statistics across channels), reshapes that mix channels, untracked tensors added to a
group, and the model's output. Attention heads are groups of their own where the attention module declares them
(``n_head`` and ``head_slots()``). Removing a group's channels gives the same outputs as
zeroing them (:func:`mask_channels_`), which the tests check.
"""

from __future__ import annotations

import difflib
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

__all__ = [
    "ChannelGroup",
    "Slot",
    "channel_groups",
    "channel_importance",
    "check_module_names",
    "keep_indices",
    "mask_channels_",
    "remove_channels_",
    "resize_to_state_dict_",
    "sync_heads_",
]

# Modules and functions with f(0) = 0, acting on each channel separately: a zeroed channel stays zero.
_PASS_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Hardtanh, nn.Identity,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.Mish, nn.Hardswish, nn.ELU, nn.SELU, nn.CELU,
)  # fmt: skip
# Hugging Face's activation modules (``transformers.activations``) of these families are elementwise with f(0) = 0.
_HF_ACTIVATIONS = ("GELU", "SiLU", "ReLU", "Mish", "Linear")
_PASS_FUNCTIONS: set[Any] = {
    F.relu, F.relu6, F.leaky_relu, F.gelu, F.silu, F.tanh, F.hardtanh, F.dropout, F.max_pool2d, F.avg_pool2d,
    F.adaptive_avg_pool2d, F.adaptive_max_pool2d, torch.relu, torch.tanh, torch.nn.functional.dropout2d,
}  # fmt: skip
_PASS_METHODS = {"relu", "relu_", "tanh", "contiguous", "clone", "detach"}
_REDUCTIONS = {"mean", "sum", "amax"}
_ADDS = {operator.add, operator.iadd, operator.sub, torch.add, torch.sub}


def is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's projections): a linear layer on the last dimension whose weight is stored
    ``(in, out)``, the transpose of ``nn.Linear``'s."""
    return type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int)


def _is_hf_activation(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__module__.startswith("transformers.activations") and any(k in cls.__name__ for k in _HF_ACTIVATIONS)


def _weight_dim(module: nn.Module, kind: str) -> int:
    """The weight dimension that holds a slot's features: output rows (``"out"``, ``"norm"``) or input columns."""
    if is_hf_conv1d(module):
        return 0 if kind == "in" else 1
    return 1 if kind == "in" else 0


class _Tracer(torch.fx.Tracer):
    """``torch.fx``'s tracer with Hugging Face's ``Conv1D`` and activation modules kept as leaves."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, _TRANSFORMER_MODULES):
            return False  # opened (its layers' structural groups are found where its code cannot be traced)
        return is_hf_conv1d(m) or _is_hf_activation(m) or super().is_leaf_module(m, module_qualified_name)


_TRANSFORMER_MODULES = (nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer,
                        nn.TransformerDecoderLayer)  # fmt: skip


def _fx_trace(model: nn.Module, concrete_args: dict[str, Any] | None = None) -> torch.fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(model, concrete_args=concrete_args)
    return torch.fx.GraphModule(tracer.root, graph, type(model).__name__)


def _bound(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The example call's arguments by ``forward``'s parameter names (defaults filled in), or None if ``forward``
    takes ``*args``/``**kwargs`` (then only a positional call is traced)."""
    import inspect

    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()):
        return None
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _trace_call(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], tracer: Callable
) -> tuple[torch.fx.GraphModule, tuple[Any, ...]]:
    """Trace ``model`` for this call: arguments that are not tensors (flags, ``None`` masks) are specialized to
    their values, so that ``forward``'s branches on them are followed. Returns the graph and its inputs."""
    if tracer is not _fx_trace:
        return tracer(model), args
    bound = _bound(model, args, kwargs)
    if bound is None:
        if kwargs:
            raise TypeError("forward takes *args/**kwargs and was called with keyword arguments")
        return _fx_trace(model), args
    concrete = {k: v for k, v in bound.items() if not isinstance(v, torch.Tensor)}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fx's note that specialized inputs are not asserted
        graph_module = _fx_trace(model, concrete or None)
    inputs = tuple(bound[n.target] for n in graph_module.graph.nodes if n.op == "placeholder" and n.target in bound)
    return graph_module, inputs


@dataclass(frozen=True)
class Slot:
    """One place where a group's channel index applies.

    Attributes:
        module: Qualified name of the module.
        kind: ``"out"`` (a producer's output channels: dim 0 of weight and bias), ``"in"`` (a consumer's input
            features: dim 1 of its weight), ``"norm"`` (a BatchNorm's per-channel parameters and statistics).
        offset: Where the group's first feature sits in that dimension (concatenation moves it).
        block: Features per channel along that dimension (a flattened ``C x H x W`` map gives ``H * W``).
    """

    module: str
    kind: str
    offset: int = 0
    block: int = 1


@dataclass
class ChannelGroup:
    """Channels removed together: ``size`` of them, at every slot in ``slots``."""

    id: int
    size: int
    slots: list[Slot] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)

    @property
    def prunable(self) -> bool:
        return not self.blocked and any(s.kind == "out" for s in self.slots)


@dataclass(frozen=True)
class _Seg:
    group: int | None  # None: fixed channels (from an untracked tensor inside a concatenation)
    size: int
    block: int = 1


@dataclass(frozen=True)
class _Value:
    dim: int  # the channel dimension (non-negative)
    segs: tuple[_Seg, ...]


class _Groups:
    def __init__(self) -> None:
        self.parent: list[int] = []
        self.groups: list[ChannelGroup] = []

    def new(self, size: int, slot: Slot) -> int:
        gid = len(self.groups)
        self.parent.append(gid)
        self.groups.append(ChannelGroup(gid, size, [slot]))
        return gid

    def find(self, gid: int) -> int:
        while self.parent[gid] != gid:
            self.parent[gid] = self.parent[self.parent[gid]]
            gid = self.parent[gid]
        return gid

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.groups[ra].slots += self.groups[rb].slots
            self.groups[ra].blocked += self.groups[rb].blocked

    def block(self, value: _Value | None, reason: str) -> None:
        if value is None:
            return
        for seg in value.segs:
            if seg.group is not None:
                group = self.groups[self.find(seg.group)]
                if reason not in group.blocked:
                    group.blocked.append(reason)

    def add_slot(self, value: _Value, module: str, kind: str) -> None:
        offset = 0
        for seg in value.segs:
            if seg.group is not None:
                self.groups[self.find(seg.group)].slots.append(Slot(module, kind, offset, seg.block))
            offset += seg.size * seg.block

    def result(self) -> list[ChannelGroup]:
        out = []
        for gid, group in enumerate(self.groups):
            if self.find(gid) == gid:
                group.slots = list(dict.fromkeys(group.slots))
                out.append(group)
        return out


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = getattr(node, "meta", {}).get("tensor_meta") if isinstance(node, torch.fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def channel_groups(
    model: nn.Module,
    example_args: Sequence[Any],
    ignore: Iterable[str] = (),
    tracer: Callable | None = None,
    example_kwargs: dict[str, Any] | None = None,
) -> list[ChannelGroup]:
    """The channel groups of ``model`` (traced with ``torch.fx`` on ``example_args``/``example_kwargs``).

    Args:
        model: Any module; where ``torch.fx`` cannot trace it whole, its submodules are traced one by one.
        example_args: Positional arguments of ``model.forward`` (shapes are propagated on them).
        ignore: Names of modules whose output channels must be kept (e.g. a layer shared with another model), as
            ``model.named_modules()`` gives them.
        tracer: Optional replacement for the tracer (``torch.fx`` with Hugging Face's ``Conv1D`` and activations as
            leaves).
        example_kwargs: Keyword arguments of the example call.

    Returns:
        Every group, prunable or blocked (``ChannelGroup.blocked`` says why).

    Raises:
        ValueError: a name in ``ignore`` is not a module of ``model`` (the closest names are suggested).
    """
    ignore = list(ignore)
    check_module_names(model, ignore, f"channel_groups(ignore={ignore!r})")
    untraced: list[str] = []
    found = _groups_of(model, tuple(example_args), dict(example_kwargs or {}), set(ignore), tracer or _fx_trace, "",
                       untraced)  # fmt: skip
    found += _head_groups(model)
    for i, group in enumerate(found):
        group.id = i
    if not any(g.prunable for g in found) and untraced:
        raise ValueError(
            f"StructuredPruning could not trace {type(model).__name__} with torch.fx, nor any submodule with "
            f"channels to prune ({'; '.join(untraced[:3])}). Data-dependent control flow or shape unpacking in "
            "forward cannot be followed."
        )
    return found


def check_module_names(model: nn.Module, names: Iterable[str], who: str, also: Iterable[str] = ()) -> None:
    """Raise a ValueError naming ``who`` (the argument) if a name in ``names`` is neither a module path of ``model``
    (as ``model.named_modules()`` gives it) nor in ``also``; the message names the closest module paths."""
    known = list(dict.fromkeys([n for n, _ in model.named_modules(remove_duplicate=False) if n] + list(also)))
    known_set = set(known)
    unknown = [name for name in names if name not in known_set]
    if not unknown:
        return
    problems = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        close += [k for k in known if k.endswith(f".{name}") and k not in close][:3]
        problems.append(f"no module {name!r}" + (f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""))
    examples = ", ".join(map(repr, known[:6])) + (", ..." if len(known) > 6 else "")
    raise ValueError(
        f"{who}: {type(model).__name__} has {'; '.join(problems)}. Name modules by their paths in the model "
        f"({examples})."
    )


def _groups_of(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    ignored: set[str],
    tracer: Callable,
    prefix: str,
    untraced: list[str],
) -> list[ChannelGroup]:
    """Groups of ``model``; where it cannot be traced whole, those of each child, traced on the arguments it
    receives in one forward pass (channels crossing a child's boundary are then left alone)."""
    try:
        graph_module, positional = _trace_call(model, args, kwargs, tracer)
        with torch.no_grad():
            ShapeProp(graph_module).propagate(*positional)
    except Exception as err:
        untraced.append(f"{prefix or type(model).__name__}: {type(err).__name__}: {str(err).splitlines()[0][:120]}")
        structural, covered = _structural_groups(model)
        children = {n: c for n, c in _callable_children(model).items() if n not in covered}
        if not children:
            return _prefixed(structural, prefix, ignored)
        captured: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

        def capture(name: str) -> Callable[..., None]:
            def hook(_module: nn.Module, a: tuple[Any, ...], k: dict[str, Any]) -> None:
                captured.setdefault(name, (a, k))

            return hook

        handles = [child.register_forward_pre_hook(capture(name), with_kwargs=True) for name, child in children.items()]
        try:
            with torch.no_grad():
                model(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        found: list[ChannelGroup] = _prefixed(structural, prefix, ignored)
        for name, child in children.items():
            if name in captured and any(True for _ in child.parameters()):
                child_args, child_kwargs = captured[name]
                found += _groups_of(child, child_args, child_kwargs, ignored, tracer, f"{prefix}{name}.", untraced)
        return found
    groups = _trace_groups(graph_module, positional, {i[len(prefix) :] for i in ignored if i.startswith(prefix)})
    for group in groups:
        group.slots = [Slot(prefix + s.module, s.kind, s.offset, s.block) for s in group.slots]
    return groups


def _prefixed(groups: list[ChannelGroup], prefix: str, ignored: set[str]) -> list[ChannelGroup]:
    for group in groups:
        group.slots = [Slot(prefix + s.module, s.kind, s.offset, s.block) for s in group.slots]
        group.blocked += [f"{s.module} is in `ignore`" for s in group.slots if s.kind == "out" and s.module in ignored]
    return groups


def _structural_groups(module: nn.Module) -> tuple[list[ChannelGroup], set[str]]:
    """Groups known from a module's structure where ``torch.fx`` cannot follow its code: the feed-forward width of
    ``nn.TransformerEncoderLayer``/``nn.TransformerDecoderLayer`` (``linear2(dropout(act(linear1(x))))`` with a
    ReLU or GELU, which keep a zeroed channel zero) and of Hugging Face's BERT-style layers. Returns the groups and
    the children they cover."""
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        act = module.activation
        if not (act in (F.relu, F.gelu) or isinstance(act, (nn.ReLU, nn.GELU))):
            return [], set()
        size = module.linear1.out_features
        return [ChannelGroup(-1, size, [Slot("linear1", "out"), Slot("linear2", "in")])], {"linear1", "linear2"}
    # Hugging Face's BERT-style layer (BERT, RoBERTa, ELECTRA, HF ViT, ...): `intermediate.dense` -> activation,
    # then `output.dense` reads the intermediate width (its forward takes **kwargs, which fx cannot trace).
    inter, out = getattr(module, "intermediate", None), getattr(module, "output", None)
    dense_in, dense_out = getattr(inter, "dense", None), getattr(out, "dense", None)
    hf_act = getattr(inter, "intermediate_act_fn", None)
    if (
        isinstance(dense_in, nn.Linear)
        and isinstance(dense_out, nn.Linear)
        and dense_out.in_features == dense_in.out_features
        and (isinstance(hf_act, _PASS_MODULES) or (isinstance(hf_act, nn.Module) and _is_hf_activation(hf_act)))
    ):
        slots = [Slot("intermediate.dense", "out"), Slot("output.dense", "in")]
        return [ChannelGroup(-1, dense_in.out_features, slots)], {"intermediate", "output"}
    return [], set()


def _hf_head_slots(module: Any) -> tuple[int, list[Slot]] | None:
    """Head groups of Hugging Face attention modules, from their structure: ``(heads, slots)`` or None.

    GPT-2 (``c_attn`` Conv1D holding q|k|v, ``c_proj``), BERT-style (``self.query/key/value`` and the sibling
    ``output.dense``) and Llama-style with grouped-query attention (``q_proj/k_proj/v_proj/o_proj``; a key/value
    head goes with its group of query heads). Their forwards infer the head count from the projections' widths."""
    name = type(module).__name__
    if name == "GPT2Attention" and not getattr(module, "is_cross_attention", False) and is_hf_conv1d(module.c_attn):
        d, inner = int(module.head_dim), int(module.c_proj.weight.shape[0])
        slots = [Slot("c_attn", "out", i * inner, d) for i in range(3)] + [Slot("c_proj", "in", 0, d)]
        return inner // d, slots
    inner_self: Any = getattr(module, "self", None)
    out = getattr(module, "output", None)
    if (
        all(isinstance(getattr(inner_self, n, None), nn.Linear) for n in ("query", "key", "value"))
        and isinstance(getattr(out, "dense", None), nn.Linear)
        and isinstance(getattr(inner_self, "attention_head_size", None), int)
    ):
        d = int(inner_self.attention_head_size)
        slots = [Slot(f"self.{n}", "out", 0, d) for n in ("query", "key", "value")] + [Slot("output.dense", "in", 0, d)]
        return inner_self.query.out_features // d, slots
    projections: list[Any] = [getattr(module, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    groups = getattr(module, "num_key_value_groups", None)
    if all(isinstance(p, nn.Linear) for p in projections) and isinstance(groups, int) and groups >= 1:
        d = int(module.head_dim)
        kv_heads = projections[1].out_features // d
        slots = [Slot("q_proj", "out", 0, d * groups), Slot("k_proj", "out", 0, d), Slot("v_proj", "out", 0, d),
                 Slot("o_proj", "in", 0, d * groups)]  # fmt: skip
        return kv_heads, slots
    return None


def _sync_hf_heads(module: Any) -> None:
    """Attributes of Hugging Face attention modules that follow the projections' widths after heads were removed."""
    if type(module).__name__ == "GPT2Attention" and is_hf_conv1d(module.c_proj):
        inner = int(module.c_proj.weight.shape[0])
        module.split_size, module.num_heads = inner, inner // int(module.head_dim)
    elif isinstance(getattr(module, "query", None), nn.Linear) and isinstance(
        getattr(module, "attention_head_size", None), int
    ):
        module.all_head_size = module.query.out_features
        module.num_attention_heads = module.all_head_size // module.attention_head_size


def _head_groups(model: nn.Module) -> list[ChannelGroup]:
    """One group per attention module that declares its heads: an integer ``n_head`` and a ``head_slots()`` method
    returning ``(submodule, "out" | "in", offset, head_dim)`` tuples (see ``CharGPT``'s attention). Removing a head
    removes its query/key/value rows and its output-projection columns; the module's ``n_head`` is then updated,
    and its ``forward`` must use ``n_head`` (not the model width) for the heads' total width."""
    groups = []
    for name, module in model.named_modules():
        slots_of = getattr(module, "head_slots", None)
        if callable(slots_of) and isinstance(getattr(module, "n_head", None), int):
            prefix = f"{name}." if name else ""
            slots = [Slot(prefix + sub, kind, offset, block) for sub, kind, offset, block in slots_of()]
            groups.append(ChannelGroup(-1, int(module.n_head), slots))
        elif (found := _hf_head_slots(module)) is not None:
            heads, slots = found
            prefix = f"{name}." if name else ""
            groups.append(ChannelGroup(-1, heads, [Slot(prefix + s.module, s.kind, s.offset, s.block) for s in slots]))
    return groups


def sync_heads_(model: nn.Module) -> None:
    """Set ``n_head`` of every module declaring its heads from its (pruned or resized) weights (and the head
    attributes of Hugging Face attention modules)."""
    for module in model.modules():
        _sync_hf_heads(module)
        slots_of = getattr(module, "head_slots", None)
        if not (callable(slots_of) and isinstance(getattr(module, "n_head", None), int)):
            continue
        sub, kind, _, block = slots_of()[0]
        same = sum(1 for s in slots_of() if s[0] == sub and s[1] == kind)
        weight = cast(torch.Tensor, module.get_submodule(sub).weight)
        module.n_head = weight.shape[1 if kind == "in" else 0] // (same * block)


def _callable_children(model: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """Direct children, with containers that are never called themselves (ModuleList, ModuleDict) opened."""
    out: dict[str, nn.Module] = {}
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            out.update(_callable_children(child, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = child
    return out


def _trace_groups(
    graph_module: torch.fx.GraphModule, example_args: tuple[Any, ...], ignored: set[str]
) -> list[ChannelGroup]:
    """Groups of a traced graph whose nodes carry shapes (``ShapeProp`` ran on ``example_args``)."""
    modules = dict(graph_module.named_modules())
    groups = _Groups()
    values: dict[torch.fx.Node, _Value | None] = {}

    def val(arg: Any) -> _Value | None:
        return values.get(arg) if isinstance(arg, torch.fx.Node) else None

    def tensor_inputs(node: torch.fx.Node) -> list[_Value]:
        found: list[_Value] = []
        torch.fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(v) if (v := val(a)) else None)
        return found

    for node in graph_module.graph.nodes:
        shape = _shape(node)
        out: _Value | None = None
        inputs = tensor_inputs(node)
        first = val(node.args[0]) if node.args else None
        if node.op == "call_module":
            module = modules[str(node.target)]
            name = str(node.target)
            if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)) or is_hf_conv1d(module):
                in_dim = 1 if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) else len(shape or (0,)) - 1
                grouped_conv = getattr(module, "groups", 1) != 1
                if first is not None:
                    if first.dim != in_dim or grouped_conv:
                        groups.block(first, f"{name} reads them along another dimension or in groups")
                    else:
                        groups.add_slot(first, name, "in")
                size = (module.out_features if isinstance(module, nn.Linear) else module.nf if is_hf_conv1d(module)
                        else module.out_channels)  # fmt: skip
                gid = groups.new(size, Slot(name, "out"))
                out = _Value(in_dim, (_Seg(gid, size),))
                if name in ignored:
                    groups.block(out, f"{name} is in `ignore`")
                elif grouped_conv:
                    groups.block(out, f"{name} is a grouped convolution")
            elif isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
                if first is not None and first.dim == 1 and all(s.block == 1 for s in first.segs):
                    groups.add_slot(first, name, "norm")
                    out = first
                else:
                    groups.block(first, f"{name} normalizes them in an unexpected layout")
            elif isinstance(module, _PASS_MODULES) or _is_hf_activation(module):
                out = first
            else:
                for v in inputs:
                    groups.block(v, f"{name} ({type(module).__name__}) is not followed by the pruner")
        elif node.op in ("call_function", "call_method"):
            target = node.target
            if target in _ADDS and len(node.args) == 2:
                a, b = (val(x) for x in node.args)
                if a is not None and b is not None:
                    out = _couple(groups, a, b, a.dim == b.dim, f"{node.name} adds tensors laid out differently")
                elif isinstance(node.args[1], (int, float)) or isinstance(node.args[0], (int, float)):
                    out = a or b
                else:
                    groups.block(a or b, f"{node.name} adds a tensor the pruner does not follow")
            elif (
                target in (operator.mul, operator.truediv, torch.mul)
                and len(node.args) == 2
                and any(isinstance(x, (int, float)) for x in node.args)
            ):
                out = next((v for v in (val(x) for x in node.args) if v is not None), None)
            elif target in (operator.mul, torch.mul) and len(node.args) == 2 and len(inputs) == 2:
                # A gated product (SwiGLU: act(gate(x)) * up(x)): a channel zeroed in either factor is zero in the
                # product, so both factors' producers lose it together.
                a, b = inputs
                same = a.dim == b.dim and _shape(node.args[0]) == _shape(node.args[1])
                out = _couple(groups, a, b, same, f"{node.name} multiplies tensors laid out differently")
            elif target in _PASS_FUNCTIONS or (node.op == "call_method" and target in _PASS_METHODS):
                out = first
            elif target in (torch.flatten,) or (node.op == "call_method" and target in ("flatten", "view", "reshape")):
                out = _flatten(first, _shape(node.args[0]), shape)
                if out is None:
                    groups.block(first, f"{node.name} ({target}) reshapes them")
            elif (node.op == "call_method" and target in _REDUCTIONS) or target in (torch.mean, torch.sum, torch.amax):
                out = _reduce(node, first, _shape(node.args[0]))
                if out is None:
                    groups.block(first, f"{node.name} reduces across them")
            elif target is torch.cat:
                out = _concat(node, values, groups)
            elif target in (getattr, "size", "dim"):
                out = None  # shapes and attributes: no channel flows on
            else:
                for v in inputs:
                    groups.block(v, f"{node.name} ({getattr(target, '__name__', target)}) is not followed")
        elif node.op == "output":
            for v in inputs:
                groups.block(v, "they are the model's output")
        values[node] = out
    return groups.result()


def _couple(groups: _Groups, a: _Value, b: _Value, same_shape: bool, reason: str) -> _Value | None:
    """Channels of two tensors combined elementwise (a residual sum, a gated product) are removed together: join
    their groups segment by segment, or block both when their channel layouts differ."""
    layout_a = [(s.size, s.block, s.group is None) for s in a.segs]
    if same_shape and layout_a == [(s.size, s.block, s.group is None) for s in b.segs]:
        for sa, sb in zip(a.segs, b.segs, strict=True):
            if sa.group is not None and sb.group is not None:
                groups.union(sa.group, sb.group)
        return a
    groups.block(a, reason)
    groups.block(b, reason)
    return None


def _flatten(value: _Value | None, before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> _Value | None:
    if value is None or before is None or after is None:
        return value
    if value.dim != 1 or len(after) != 2 or after[0] != before[0] or after[1] != math.prod(before[1:]):
        return None
    spatial = math.prod(before[2:])
    return _Value(1, tuple(_Seg(s.group, s.size, s.block * spatial) for s in value.segs))


def _reduce(node: torch.fx.Node, value: _Value | None, before: tuple[int, ...] | None) -> _Value | None:
    if value is None or before is None:
        return value
    raw: Any = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if raw is None:
        return None
    dims = tuple(int(d) % len(before) for d in ((raw,) if isinstance(raw, int) else raw))
    if value.dim in dims or any(s.block != 1 for s in value.segs):
        return None
    keepdim = bool(node.kwargs.get("keepdim", len(node.args) > 2 and node.args[2]))
    return _Value(value.dim if keepdim else value.dim - sum(int(d < value.dim) for d in dims), value.segs)


def _concat(node: torch.fx.Node, values: dict[torch.fx.Node, _Value | None], groups: _Groups) -> _Value | None:
    tensors: Any = node.args[0]
    dim: Any = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    shapes = [_shape(t) for t in tensors]
    if any(s is None for s in shapes):
        return None
    rank = len(shapes[0])  # type: ignore[arg-type]
    dim = int(dim) % rank
    segs: list[_Seg] = []
    for t, s in zip(tensors, shapes, strict=True):
        v = values.get(t)
        if v is not None and v.dim == dim:
            segs += v.segs
        else:
            if v is not None:
                groups.block(v, f"{node.name} concatenates along another dimension")
            segs.append(_Seg(None, s[dim]))  # type: ignore[index]
    return _Value(dim, tuple(segs))


def channel_importance(
    model: nn.Module, group: ChannelGroup, criterion: str = "l2", grads: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """Importance of each of the group's channels (higher is kept).

    ``"l2"``: the L2 norm of all weights attached to the channel across the group's producers, consumers and
    norms (filter norms, Li et al., 2017, extended over the coupled layers). ``"taylor"``: first-order Taylor
    importance, the squared sum of ``w * grad`` over those weights (Molchanov et al., 2019), from ``grads``
    (accumulated ``(w * grad)`` per parameter name, see :class:`StructuredPruning`).
    """
    total = torch.zeros(group.size, dtype=torch.float64)
    for slot in group.slots:
        module = model.get_submodule(slot.module)
        for pname, param in module.named_parameters(recurse=False):
            source = param.detach() if criterion == "l2" else (grads or {}).get(f"{slot.module}.{pname}")
            if source is None:
                continue
            dim = _weight_dim(module, slot.kind) if param.ndim >= 2 else 0
            if slot.kind == "in" and param.ndim < 2:
                continue
            lines = source.transpose(0, dim).reshape(source.shape[dim], -1)
            per = lines[slot.offset : slot.offset + group.size * slot.block].reshape(group.size, -1)
            per = per.double()
            total += per.pow(2).sum(1) if criterion == "l2" else per.sum(1).pow(2)
    return total.sqrt() if criterion == "l2" else total


def keep_indices(
    importance: torch.Tensor, amount: float = 0.0, *, count: int | None = None, round_to: int = 1
) -> torch.Tensor:
    """Indices (ascending) of the channels kept when removing the fraction ``amount`` of lowest importance (or
    keeping exactly ``count``). At least one channel is kept; the kept count is rounded down to a multiple of
    ``round_to`` where possible."""
    size = importance.numel()
    keep = count if count is not None else size - math.floor(amount * size + 1e-9)
    keep = max(1, min(size, keep))
    if round_to > 1 and keep >= round_to:
        keep -= keep % round_to
    order = torch.argsort(importance, descending=True, stable=True)
    return order[:keep].sort().values


def _positions(segments: list[tuple[int, int, int, torch.Tensor | None]], length: int) -> torch.Tensor:
    """Kept positions along a dimension of ``length`` made of segments ``(offset, size, block, keep)``."""
    keep = torch.ones(length, dtype=torch.bool)
    for offset, size, block, kept in segments:
        if kept is None:
            continue
        drop = torch.ones(size, dtype=torch.bool)
        drop[kept] = False
        keep[offset : offset + size * block] = ~drop.repeat_interleave(block)
    return keep.nonzero().reshape(-1)


def _plan(
    groups: Sequence[ChannelGroup], kept: dict[int, torch.Tensor]
) -> dict[tuple[str, str], list[tuple[int, int, int, torch.Tensor | None]]]:
    plan: dict[tuple[str, str], list[tuple[int, int, int, torch.Tensor | None]]] = {}
    for group in groups:
        if group.id not in kept:
            continue
        for slot in group.slots:
            plan.setdefault((slot.module, slot.kind), []).append((slot.offset, group.size, slot.block, kept[group.id]))
    return plan


@torch.no_grad()
def mask_channels_(model: nn.Module, groups: Sequence[ChannelGroup], kept: dict[int, torch.Tensor]) -> None:
    """Zero the removed channels in place without changing shapes (the reference for :func:`remove_channels_`):
    producers' output rows and biases, and BatchNorm's scale and shift."""
    for (name, kind), segments in _plan(groups, kept).items():
        if kind == "in":
            continue
        module = model.get_submodule(name)
        weight = cast(torch.Tensor, module.weight)
        dim = _weight_dim(module, kind)
        rows = _positions(segments, weight.shape[dim])
        drop = torch.ones(weight.shape[dim], dtype=torch.bool)
        drop[rows] = False
        weight.transpose(0, dim)[drop] = 0
        bias = getattr(module, "bias", None)
        if bias is not None:
            bias[drop] = 0


def remove_channels_(
    model: nn.Module,
    groups: Sequence[ChannelGroup],
    kept: dict[int, torch.Tensor],
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> dict[str, tuple[int, ...]]:
    """Remove every channel not in ``kept[group.id]`` from the model, in place.

    Changed parameters are replaced by new ones (fresh autograd leaves) in the modules and in ``optimizers``,
    whose state tensors shaped like the parameter (momentum, Adam's moments) are sliced the same way.

    Returns:
        The new shape of every changed parameter or buffer, by qualified name.
    """
    plan = _plan(groups, kept)
    selections: dict[str, list[tuple[int, torch.Tensor]]] = {}  # param name -> [(dim, index)]
    for (name, kind), segments in plan.items():
        module = model.get_submodule(name)
        weight_dim = _weight_dim(module, kind)
        length = cast(torch.Tensor, module.weight).shape[weight_dim]
        index = _positions(segments, length)
        for pname, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            dim = weight_dim if pname == "weight" else 0
            if tensor is None or tensor.ndim <= dim or (kind == "in" and pname != "weight"):
                continue
            if kind != "in" and tensor.shape[dim] != length:
                continue  # e.g. BatchNorm's num_batches_tracked
            selections.setdefault(f"{name}.{pname}", []).append((dim, index))
        _update_attributes(module, kind, index.numel())
    changed: dict[str, tuple[int, ...]] = {}
    with torch.no_grad():
        for qualified, picks in selections.items():
            module_name, _, attr = qualified.rpartition(".")
            owner = model.get_submodule(module_name)

            def select(t: torch.Tensor, picks: list[tuple[int, torch.Tensor]] = picks) -> torch.Tensor:
                for dim, index in picks:
                    t = t.index_select(dim, index.to(t.device))
                return t.contiguous()

            if attr in owner._buffers:
                owner._buffers[attr] = select(owner._buffers[attr])  # type: ignore[arg-type]
                changed[qualified] = tuple(owner._buffers[attr].shape)  # type: ignore[union-attr]
                continue
            old = owner._parameters[attr]
            assert old is not None
            # A new leaf: autograd (and DDP's reducer) cache per-parameter accumulators holding the old shape.
            new = nn.Parameter(select(old.detach()), requires_grad=old.requires_grad)
            owner._parameters[attr] = new
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["params"] = [new if p is old else p for p in group["params"]]
                if old in optimizer.state:
                    entry = optimizer.state.pop(old)
                    optimizer.state[new] = {
                        k: select(v) if isinstance(v, torch.Tensor) and v.shape == old.shape else v
                        for k, v in entry.items()
                    }
            changed[qualified] = tuple(new.shape)
    sync_heads_(model)
    return changed


def _update_attributes(module: nn.Module, kind: str, size: int) -> None:
    if is_hf_conv1d(module):
        if kind != "in":
            setattr(module, "nf", size)  # noqa: B010 (an attribute of Hugging Face's class)
    elif isinstance(module, nn.Linear):
        if kind == "in":
            module.in_features = size
        else:
            module.out_features = size
    elif isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        if kind == "in":
            module.in_channels = size
        else:
            module.out_channels = size
    elif isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        module.num_features = size


@torch.no_grad()
def resize_to_state_dict_(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Give ``model``'s parameters and buffers the shapes they have in ``state_dict`` (a pruned checkpoint), and
    update the layers' size attributes, so that ``load_state_dict`` then succeeds. Returns the resized names."""
    resized = []
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, saved in state_dict.items():
        tensor = tensors.get(name)
        if tensor is None or not isinstance(saved, torch.Tensor) or tuple(saved.shape) == tuple(tensor.shape):
            continue
        if tensor.ndim != saved.ndim:
            raise ValueError(f"resize_to_state_dict_: `{name}` is {tuple(tensor.shape)} here, {tuple(saved.shape)} "
                             "in the checkpoint; only channel counts can differ.")  # fmt: skip
        tensor.data = torch.zeros(saved.shape, dtype=tensor.dtype, device=tensor.device)
        resized.append(name)
        module_name, _, pname = name.rpartition(".")
        module = model.get_submodule(module_name)
        if pname == "weight" and is_hf_conv1d(module):
            _update_attributes(module, "out", saved.shape[1])
        elif pname == "weight" and isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            _update_attributes(module, "out", saved.shape[0])
            _update_attributes(module, "in", saved.shape[1] * getattr(module, "groups", 1))
        elif isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            _update_attributes(module, "norm", saved.shape[0])
    sync_heads_(model)
    return resized
