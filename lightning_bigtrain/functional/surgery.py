"""Module surgery: rewrite parts of a model's forward into faster or leaner equivalents, in place.

Every swap keeps the module's class, methods, parameters and ``state_dict`` keys: a module whose ``forward``
matches a pattern gets an instance-level ``forward`` generated from its ``torch.fx`` graph with the pattern
replaced (each submodule is traced as a leaf, so parents and children are rewritten independently). Swaps:

* ``"attention"``: attention written by hand, ``softmax(q @ k.transpose(-2, -1) * scale [masked]) [dropout] @ v``,
  becomes one :func:`torch.nn.functional.scaled_dot_product_attention` call (the fused kernel never stores the
  L x S score matrix for backward). A ``masked_fill(mask == 0, -inf)`` with a lower-triangular buffer becomes
  ``is_causal=True``; other boolean or additive masks are passed as ``attn_mask``; an ``nn.Dropout`` on the
  weights becomes ``dropout_p`` (active in training only, like the module). Equal in outputs and gradients
  to float rounding; with dropout the same in distribution, not in the random draws. On CPU, SDPA has no fused
  kernel with dropout, so there a swap with active dropout computes the weights as written in training
  (:func:`fused_attention`); :func:`sdpa_fallbacks` names those swaps.
* ``"norm_activation"``: a LayerNorm / GroupNorm / RMSNorm whose only user is an activation runs as one
  recomputed unit: only the norm's input is kept for backward and norm + activation are recomputed there
  (Chen et al., 2016, "Training Deep Nets with Sublinear Memory Cost"), so the activation's saved tensor is
  not stored. Bit-equal outputs and gradients. BatchNorm is left alone in training (recomputing it would
  update its running statistics twice).
* :func:`fold_conv_bn` (evaluation only): Conv + BatchNorm pairs folded into one convolution,
  ``w' = w * gamma / sqrt(var + eps)``, ``b' = (b - mean) * gamma / sqrt(var + eps) + beta``.

A rewritten forward bakes the Python values it read (``self.n_head``); when the module's structure changes
afterwards (structured pruning replaces layers and head counts), the next call outside ``torch.compile``
re-traces it (:func:`refresh_swaps` does it explicitly), and a module that no longer matches gets its own
forward back. :func:`restore_modules` undoes every swap.
"""

from __future__ import annotations

import copy
import itertools
import math
import operator
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "SWAP_KINDS",
    "Swap",
    "check_kinds",
    "fold_conv_bn",
    "refresh_swaps",
    "restore_modules",
    "sdpa_fallbacks",
    "swap_modules",
]

SWAP_KINDS = ("attention", "norm_activation")
_STATE = "_bigtrain_surgery"
_NORMS = (nn.LayerNorm, nn.GroupNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()))
_ACT_MODULES = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Mish, nn.Hardswish, nn.LeakyReLU, nn.ELU,
                nn.ReLU6, nn.Softplus)  # fmt: skip
_ACT_FUNCTIONS: dict[Any, str] = {
    F.gelu: "gelu", F.relu: "relu", torch.relu: "relu", F.silu: "silu", torch.sigmoid: "sigmoid",
    F.sigmoid: "sigmoid", torch.tanh: "tanh", F.tanh: "tanh", F.mish: "mish", F.hardswish: "hardswish",
    F.leaky_relu: "leaky_relu", F.elu: "elu", F.relu6: "relu6", F.softplus: "softplus",
}  # fmt: skip
_ACT_METHODS = {"relu": "relu", "sigmoid": "sigmoid", "tanh": "tanh"}
_ACT_BY_NAME: dict[str, Callable[..., torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "mish": F.mish, "hardswish": F.hardswish, "leaky_relu": F.leaky_relu, "elu": F.elu, "relu6": F.relu6,
    "softplus": F.softplus,
}  # fmt: skip
_MATMUL = (operator.matmul, torch.matmul)
_SOFTMAX = (F.softmax, torch.softmax)
_SCALAR_OPS = (operator.getitem, operator.mul, operator.truediv, operator.pow, operator.add, operator.sub,
               operator.floordiv, math.sqrt)  # fmt: skip
_NEG_INF_FILL = -1e9  # a fill at or below this is "never attend": exp underflows to exactly 0 in fp32/bf16


@dataclass(frozen=True)
class Swap:
    """One rewrite: where (module path, "" for the root), which kind, and what was matched; for an attention
    swap, the dropout module on the weights (its path in the swapped module), if any."""

    path: str
    kind: str
    detail: str
    dropout: str | None = None


# ------------------------------------------------------------------------------------ replacement kernels
def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    dropout_p: float,
    training: bool,
) -> torch.Tensor:
    """What an ``"attention"`` swap calls: SDPA with the matched mask, scale and (training-only) dropout.

    On CPU, SDPA has no fused kernel with dropout (it runs its unfused reference path, which also stores the
    score matrix and is slower than the written code; see ``docs/fusion.md``): there, in training with
    ``dropout_p > 0``, the weights are computed as written. :func:`sdpa_fallbacks` names the swaps this applies
    to, so that callers do not report them as SDPA."""
    if training and dropout_p > 0 and q.device.type == "cpu":
        scores = (q @ k.transpose(-2, -1)) * scale
        if is_causal:
            keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        elif attn_mask is not None:
            bool_mask = attn_mask.dtype == torch.bool
            scores = scores.masked_fill(~attn_mask, float("-inf")) if bool_mask else scores + attn_mask
        return F.dropout(scores.softmax(dim=-1), dropout_p) @ v
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p if training else 0.0, is_causal=is_causal, scale=scale
    )


def recomputed_norm_activation(
    x: torch.Tensor, norm: nn.Module, act: nn.Module | str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> torch.Tensor:
    """What a ``"norm_activation"`` swap calls: ``act(norm(x))`` keeping only ``x`` for backward."""
    fn = act if isinstance(act, nn.Module) else _ACT_BY_NAME[act]

    def unit(t: torch.Tensor) -> torch.Tensor:
        return fn(norm(t), *args, **kwargs)

    if not torch.is_grad_enabled():
        return unit(x)
    return checkpoint(unit, x, use_reentrant=False, preserve_rng_state=False)


# --------------------------------------------------------------------------------------------- public API
def swap_modules(model: nn.Module, kinds: Iterable[str] = SWAP_KINDS) -> list[Swap]:
    """Rewrite every submodule of ``model`` (and ``model`` itself) whose forward matches one of ``kinds``.

    Modules torch.fx cannot trace (data-dependent control flow) are skipped: their children are still
    tried. Calling it again re-traces modules whose structure changed and leaves the others. Returns the
    swaps in place after the call.
    """
    kinds = check_kinds(kinds)
    found: list[Swap] = []
    for path, module in _candidates(model):
        state = module.__dict__.get(_STATE)
        if state is not None and state.kinds == kinds and state.key == _structure_key(module):
            found += state.swaps
            continue
        found += _rewrite(module, path, kinds)
    return found


def refresh_swaps(model: nn.Module) -> list[Swap]:
    """Re-trace swapped modules whose structure changed since they were rewritten (see the module doc)."""
    found: list[Swap] = []
    for path, module in model.named_modules():
        state = module.__dict__.get(_STATE)
        if state is None:
            continue
        found += state.swaps if state.key == _structure_key(module) else _rewrite(module, path, state.kinds)
    return found


def sdpa_fallbacks(model: nn.Module, swaps: Iterable[Swap]) -> list[Swap]:
    """The attention swaps of ``model`` that compute the weights as written in training instead of calling SDPA:
    those with a dropout (``p > 0``) on the weights in a module whose tensors are on CPU (see
    :func:`fused_attention`). In evaluation, or on another device, they run SDPA."""
    found = []
    for swap in swaps:
        if swap.kind != "attention" or swap.dropout is None:
            continue
        module = model.get_submodule(swap.path)
        dropout = module.get_submodule(swap.dropout)
        tensors = itertools.chain(module.parameters(), module.buffers())
        device = next((t.device for t in tensors), torch.device("cpu"))
        if getattr(dropout, "p", 0.0) > 0 and device.type == "cpu":
            found.append(swap)
    return found


def restore_modules(model: nn.Module) -> int:
    """Give every swapped module of ``model`` its own forward back; returns how many were restored."""
    restored = 0
    for module in model.modules():
        if module.__dict__.pop(_STATE, None) is not None:
            module.__dict__.pop("forward", None)
            restored += 1
    return restored


def fold_conv_bn(model: nn.Module, *, inplace: bool = False) -> nn.Module:
    """``model`` for evaluation with each BatchNorm that directly follows a convolution folded into it.

    Pairs are found as neighbours in ``nn.Sequential`` containers and, in other modules, through their
    ``torch.fx`` graph (the convolution's only user is the BatchNorm, each called once). The folded
    BatchNorm becomes ``nn.Identity``. Returns a folded copy in eval mode (``inplace=True`` folds ``model``
    itself); train it no further: the BatchNorm's batch statistics are gone.

    Raises:
        ValueError: a BatchNorm after a convolution has no running statistics (``track_running_stats=False``).
    """
    target = model if inplace else copy.deepcopy(model)
    target.eval()
    for _, module in list(target.named_modules()):
        for conv_name, bn_name in _conv_bn_pairs(module):
            conv, bn = module.get_submodule(conv_name), module.get_submodule(bn_name)
            if not (isinstance(conv, _CONVS) and isinstance(bn, _BNS)):  # _conv_bn_pairs chose them by type
                raise TypeError(f"fold_conv_bn: {conv_name} -> {bn_name} is not a Conv -> BatchNorm pair.")
            _fold_into(conv, bn, f"{type(module).__name__}.{bn_name}")
            _set_submodule(module, bn_name, nn.Identity())
    return target


# ------------------------------------------------------------------------------------------------ tracing
class _LeafTracer(fx.Tracer):
    """Every submodule is a leaf: a module's graph holds its own code only."""

    def __init__(self) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


def check_kinds(kinds: str | Iterable[str], who: str | None = None) -> tuple[str, ...]:
    """``kinds`` as a tuple of known swap kinds; a ValueError naming ``who`` (the argument) otherwise."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    unknown = [k for k in kinds if k not in SWAP_KINDS]
    if unknown:
        raise ValueError(
            f"{who or f'swap_modules(kinds={kinds!r})'}: unknown swap kind(s) {unknown}; choose from "
            f"{', '.join(SWAP_KINDS)}."
        )
    return kinds


def _candidates(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules whose own forward may hold a pattern: user classes (not torch.nn's, not containers)."""
    for path, module in model.named_modules():
        cls = type(module)
        if cls.__module__.startswith("torch.") or isinstance(module, nn.Sequential | nn.ModuleList | nn.ModuleDict):
            continue
        yield path, module


def _structure_key(module: nn.Module) -> tuple[Any, ...]:
    """What a traced forward may have baked in: the submodules' identities and scalar attributes."""
    key = []
    for name, m in module.named_modules():
        scalars = tuple(
            (k, v)
            for k, v in m.__dict__.items()
            if isinstance(v, int | float | str | bool) and k != "training" and not k.startswith("_")
        )
        key.append((name, id(m), scalars))
    return tuple(key)


@dataclass
class _State:
    path: str
    kinds: tuple[str, ...]
    key: tuple[Any, ...]
    fn: Callable[..., Any]
    swaps: list[Swap]


def _checked_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _State = self.__dict__[_STATE]
    if not torch.compiler.is_compiling() and state.key != _structure_key(self):
        _rewrite(self, state.path, state.kinds)
        if _STATE not in self.__dict__:  # no longer matches: its own forward again
            return self.forward(*args, **kwargs)
        state = self.__dict__[_STATE]
    return state.fn(self, *args, **kwargs)


def _rewrite(module: nn.Module, path: str, kinds: tuple[str, ...]) -> list[Swap]:
    """Trace ``module``'s own forward, replace every match, bind the result; [] (and restored) if none."""
    module.__dict__.pop(_STATE, None)
    module.__dict__.pop("forward", None)
    try:
        graph = _LeafTracer().trace(module)
    except Exception:
        return []
    swaps: list[Swap] = []
    if "attention" in kinds:
        swaps += [Swap(path, "attention", d, dropout) for d, dropout in _swap_attention(graph, module)]
    if "norm_activation" in kinds:
        swaps += [Swap(path, "norm_activation", d) for d in _swap_norm_activation(graph, module)]
    if not swaps:
        return []
    graph.lint()
    gm = fx.GraphModule(module, graph)
    missing = [n.target for n in graph.nodes if n.op in ("get_attr", "call_module") and not _has_attr(module, _path(n))]
    if missing:  # constants the tracer created live on the GraphModule only: keep the module as it is
        return []
    module.__dict__[_STATE] = _State(path, kinds, _structure_key(module), type(gm).forward, swaps)
    module.__dict__["forward"] = types.MethodType(_checked_forward, module)
    return swaps


def _has_attr(module: nn.Module, target: str) -> bool:
    obj: Any = module
    for part in target.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _path(node: fx.Node) -> str:
    """The attribute path a ``call_module`` or ``get_attr`` node refers to (their targets are strings)."""
    if not isinstance(node.target, str):
        raise TypeError(f"{node.op} node {node.name} has a non-string target {node.target!r}")
    return node.target


def _only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _is_scalar_expr(value: Any) -> bool:
    """A Python number, or an FX node computing one from sizes and numbers (``1 / math.sqrt(k.size(-1))``)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return True
    if not isinstance(value, fx.Node):
        return False
    if value.op == "call_method" and value.target == "size":
        return True
    if value.op == "call_function" and value.target is getattr and value.args[1] == "shape":
        return True
    if value.op == "call_function" and (
        getattr(value.target, "__module__", None) == "math"
        or value.target in _SCALAR_OPS
        or getattr(value.target, "__name__", "") in ("math_sqrt",)
    ):
        return all(_is_scalar_expr(a) for a in value.args if not isinstance(a, slice))
    return False


def _erase_dead(graph: fx.Graph, matched: Iterable[fx.Node]) -> None:
    """Erase the ``matched`` nodes (consumers first; replaced, so unused) and any pure producer of theirs
    left without users."""
    pending: list[fx.Node] = []
    erased = set()
    for node in matched:
        pending += node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)
    while pending:
        node = pending.pop()
        if node in erased or node.users or node.op not in ("call_function", "call_method", "get_attr"):
            continue
        pending += node.all_input_nodes
        graph.erase_node(node)
        erased.add(node)


# ------------------------------------------------------------------------------------- attention pattern
def _swap_attention(graph: fx.Graph, module: nn.Module) -> list[tuple[str, str | None]]:
    """Rewrite each matched attention in ``graph``; per match, its description and its dropout module's path."""
    done: list[tuple[str, str | None]] = []
    for softmax in [n for n in graph.nodes if _is_softmax(n)]:
        match = _match_attention(softmax, module)
        if match is None:
            continue
        chain, out, q, k, v, scale, mask, causal, dropout = match
        with graph.inserting_before(out):
            if isinstance(mask, tuple):  # masked_fill(cond, -inf): attend where cond is False
                mask = graph.call_function(torch.logical_not, (mask[1],))
            if isinstance(scale, tuple):  # divided by a computed value
                scale = graph.call_function(operator.truediv, (1.0, scale[1]))
            p: float | fx.Node
            training: bool | fx.Node
            if dropout is None:
                p, training = 0.0, False
            else:
                p, training = graph.get_attr(f"{dropout}.p"), graph.get_attr(f"{dropout}.training")
            new = graph.call_function(fused_attention, (q, k, v, mask, scale, causal, p, training))
        out.replace_all_uses_with(new)
        _erase_dead(graph, [out, *reversed(chain)])
        given = "none" if mask is None else "given"
        detail = (f"softmax(q @ k^T) @ v -> scaled_dot_product_attention(is_causal={causal}, mask={given}, "
                  f"dropout={'none' if dropout is None else dropout})")  # fmt: skip
        done.append((detail, dropout))
    return done


def _is_softmax(node: fx.Node) -> bool:
    function = node.op == "call_function" and node.target in _SOFTMAX
    if function or (node.op == "call_method" and node.target == "softmax"):
        dim, dtype = _arg(node, 1, "dim"), node.kwargs.get("dtype")
    else:
        return False
    return dim == -1 and dtype is None


def _match_attention(softmax: fx.Node, module: nn.Module) -> tuple[Any, ...] | None:
    """Walk back from softmax through [mask] [scale] to ``q @ k^T``, forward through [dropout] to ``@ v``."""
    chain = [softmax]
    after = _only_user(softmax)
    dropout = None
    if after is not None and after.op == "call_module" and isinstance(module.get_submodule(_path(after)), nn.Dropout):
        dropout = _path(after)
        chain.append(after)
        after = _only_user(after)
    if after is None or after.op != "call_function" or after.target not in _MATMUL or after.args[0] is not chain[-1]:
        return None
    out, v = after, after.args[1]
    scores = softmax.args[0]
    mask: Any = None
    causal = False
    scale: Any = 1.0
    # mask (outermost), then scale, then the matmul
    if isinstance(scores, fx.Node) and _is_masked_fill(scores):
        fill = _arg(scores, 2, "value")
        if not isinstance(fill, int | float) or fill > _NEG_INF_FILL:
            return None
        cond = scores.args[1]
        causal = _is_causal_condition(cond, module)
        mask = None if causal else ("not", cond)
        chain.insert(0, scores)
        scores = scores.args[0]
    elif isinstance(scores, fx.Node) and scores.op == "call_function" and scores.target in (operator.add, torch.add):
        a, b = scores.args[:2]
        inner, added = (a, b) if _leads_to_scores(a) else (b, a) if _leads_to_scores(b) else (None, None)
        if inner is None or not isinstance(added, fx.Node):
            return None
        mask = added
        chain.insert(0, scores)
        scores = inner
    if isinstance(scores, fx.Node) and scores.op == "call_function" and scores.target in (operator.mul, torch.mul):
        a, b = scores.args[:2]
        if _is_scalar_expr(b) and isinstance(a, fx.Node):
            inner, scale = a, b
        elif _is_scalar_expr(a) and isinstance(b, fx.Node):
            inner, scale = b, a
        else:
            return None
        chain.insert(0, scores)
        scores = inner
    elif isinstance(scores, fx.Node) and scores.op == "call_function" and scores.target is operator.truediv:
        a, b = scores.args[:2]
        if not _is_scalar_expr(b) or not isinstance(a, fx.Node):
            return None
        chain.insert(0, scores)
        # a divisor node becomes 1 / divisor in the graph only once the whole pattern matched
        scores, scale = a, (1.0 / b if isinstance(b, int | float) else ("reciprocal", b))
    if not (isinstance(scores, fx.Node) and scores.op == "call_function" and scores.target in _MATMUL):
        return None
    kt = scores.args[1]
    if not (isinstance(kt, fx.Node) and _is_last_two_transpose(kt)):
        return None
    chain.insert(0, scores)
    if any(len(n.users) != 1 for n in chain):  # the weights are used elsewhere (returned, logged): keep them
        return None
    return chain, out, scores.args[0], kt.args[0], v, scale, mask, causal, dropout


def _leads_to_scores(node: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_function" and node.target in (operator.mul, torch.mul, operator.truediv):
        node = next((a for a in node.args[:2] if isinstance(a, fx.Node) and not _is_scalar_expr(a)), None)
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _MATMUL


def _is_masked_fill(node: fx.Node) -> bool:
    return (node.op == "call_method" and node.target == "masked_fill") or (
        node.op == "call_function" and node.target is torch.masked_fill
    )


def _is_last_two_transpose(node: fx.Node) -> bool:
    method = node.op == "call_method" and node.target == "transpose"
    if method or (node.op == "call_function" and node.target is torch.transpose):
        dims = node.args[1:3]
    else:
        return False
    return tuple(dims) in ((-2, -1), (-1, -2))


def _is_causal_condition(cond: Any, module: nn.Module) -> bool:
    """``buffer[..., :L, :S] == 0`` where the buffer's last two dimensions are a lower-triangular mask of
    ones: masking it is SDPA's ``is_causal`` (both align the triangle top-left)."""
    if not (isinstance(cond, fx.Node) and cond.op == "call_function" and cond.target is operator.eq):
        return False
    sliced, zero = cond.args[:2]
    if zero != 0 or not isinstance(sliced, fx.Node):
        return False
    index: Any = ()
    if sliced.op == "call_function" and sliced.target is operator.getitem:
        sliced, index = sliced.args
        index = index if isinstance(index, tuple) else (index,)
        if not all(isinstance(s, slice) and s.start in (None, 0) and s.step in (None, 1) for s in index):
            return False
    if not (isinstance(sliced, fx.Node) and sliced.op == "get_attr"):
        return False
    buffer = module.get_buffer(_path(sliced)) if _has_attr(module, _path(sliced)) else None
    if not isinstance(buffer, torch.Tensor) or buffer.dim() < 2 or buffer.shape[-1] != buffer.shape[-2]:
        return False
    if any(d != 1 for d in buffer.shape[:-2]) or len(index) > buffer.dim():
        return False
    square = buffer.reshape(buffer.shape[-2:]) != 0
    return bool(torch.equal(square, torch.ones_like(square).tril()))


# ----------------------------------------------------------------------------- norm + activation pattern
def _swap_norm_activation(graph: fx.Graph, module: nn.Module) -> list[str]:
    done = []
    for norm in [n for n in graph.nodes if n.op == "call_module"]:
        if not isinstance(module.get_submodule(_path(norm)), _NORMS):
            continue
        act = _only_user(norm)
        if act is None or act.args[:1] != (norm,):
            continue
        args: tuple[Any, ...]
        kwargs: dict[str, Any]
        if act.op == "call_module" and isinstance(module.get_submodule(_path(act)), _ACT_MODULES):
            if len(act.args) != 1 or act.kwargs:
                continue
            name = _path(act)
            args, kwargs = (), {}
        elif act.op == "call_function" and act.target in _ACT_FUNCTIONS:
            name = _ACT_FUNCTIONS[act.target]
            args, kwargs = tuple(act.args[1:]), {k: v for k, v in act.kwargs.items() if k != "inplace"}
        elif act.op == "call_method" and act.target in _ACT_METHODS and len(act.args) == 1 and not act.kwargs:
            name = _ACT_METHODS[act.target]
            args, kwargs = (), {}
        else:
            continue
        if any(isinstance(a, fx.Node) for a in (*args, *kwargs.values())):
            continue
        with graph.inserting_before(act):
            norm_mod = graph.get_attr(_path(norm))
            fn = graph.get_attr(_path(act)) if act.op == "call_module" else name
            new = graph.call_function(recomputed_norm_activation, (norm.args[0], norm_mod, fn, args, kwargs))
        act.replace_all_uses_with(new)
        graph.erase_node(act)
        graph.erase_node(norm)
        done.append(f"{norm.target} -> {name}: recomputed in backward")
    return done


# ------------------------------------------------------------------------------------------ Conv+BN fold
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BNS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _conv_bn_pairs(module: nn.Module) -> list[tuple[str, str]]:
    if isinstance(module, nn.Sequential):
        items = list(module.named_children())
        return [(a, b) for (a, ma), (b, mb) in itertools.pairwise(items)
                if isinstance(ma, _CONVS) and isinstance(mb, _BNS)]  # fmt: skip
    if type(module).__module__.startswith("torch.") or isinstance(module, nn.ModuleList | nn.ModuleDict):
        return []
    try:
        graph = _LeafTracer().trace(module)
    except Exception:
        return []
    calls: dict[str, int] = {}
    for n in graph.nodes:
        if n.op == "call_module":
            calls[_path(n)] = calls.get(_path(n), 0) + 1
    pairs = []
    for n in graph.nodes:
        if n.op != "call_module" or not isinstance(module.get_submodule(_path(n)), _CONVS):
            continue
        user = _only_user(n)
        if (user is not None and user.op == "call_module" and isinstance(module.get_submodule(_path(user)), _BNS)
                and user.args[:1] == (n,) and calls[_path(n)] == 1 and calls[_path(user)] == 1):  # fmt: skip
            pairs.append((_path(n), _path(user)))
    return pairs


@torch.no_grad()
def _fold_into(
    conv: nn.Conv1d | nn.Conv2d | nn.Conv3d, bn: nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d, where: str
) -> None:
    mean, var = bn.running_mean, bn.running_var
    if mean is None or var is None:
        raise ValueError(
            f"fold_conv_bn: {where} has no running statistics (track_running_stats=False); it normalizes with "
            "batch statistics and cannot be folded."
        )
    if conv.out_channels != bn.num_features:
        raise ValueError(f"fold_conv_bn: {conv} feeds {bn} with a different channel count.")
    gamma = bn.weight if bn.weight is not None else torch.ones_like(mean)
    beta = bn.bias if bn.bias is not None else torch.zeros_like(mean)
    factor = gamma / torch.sqrt(var + bn.eps)
    shape = (-1,) + (1,) * (conv.weight.dim() - 1)
    conv.weight.mul_(factor.reshape(shape).to(conv.weight.dtype))
    bias = conv.bias if conv.bias is not None else torch.zeros_like(mean)
    new_bias = (bias - mean) * factor + beta
    conv.bias = nn.Parameter(new_bias.to(conv.weight.dtype), requires_grad=conv.weight.requires_grad)


def _set_submodule(module: nn.Module, target: str, new: nn.Module) -> None:
    parent_name, _, name = target.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    setattr(parent, name, new)
