"""Choosing and applying FSDP2 sharding units for any module (ZeRO stages 2 and 3)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "CommCounter",
    "auto_wrap_targets",
    "count_comm_",
    "divided_over",
    "is_fully_sharded",
    "is_replica",
    "local_view",
    "part_norms",
    "part_powers",
    "shard_like_",
    "shard_module_",
]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def local_view(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's local shard (a view sharing its storage), else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_replica(t: torch.Tensor) -> bool:
    """Whether every rank holds the whole of ``t``: not a DTensor shard, not a DeepSpeed-partitioned parameter."""
    if hasattr(t, "ds_tensor"):
        return False
    placements = getattr(t, "placements", None)
    return placements is None or all(p.is_replicate() for p in placements)


def divided_over(t: torch.Tensor) -> tuple[Any, ...]:
    """The process groups over which ``t`` (a DTensor) is divided: one per mesh dimension it is not replicated on
    (Shard, and FSDP2's _StridedShard of a tensor-parallel shard, which is not a Shard). Empty for a plain tensor."""
    placements = getattr(t, "placements", None)
    if not placements:
        return ()
    mesh = getattr(t, "device_mesh")  # noqa: B009 (a DTensor's)
    return tuple(mesh.get_group(i) for i, pl in enumerate(placements) if not pl.is_replicate())


def part_powers(parts: Sequence[tuple[torch.Tensor | None, tuple[Any, ...]]], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-th power sum (the largest absolute entry for ``inf``) of each of several tensors held in parts
    across ranks, in float32.

    ``parts[i]`` is ``(local, groups)``: this rank's part of tensor ``i`` (None: none of it) and the process groups
    over whose ranks its parts are disjoint (summed over each, in turn: the data-parallel ranks of a flat partition,
    every divided mesh dimension of a DTensor, :func:`divided_over`); ``()`` for a tensor every rank holds whole
    (counted once). The parts' local sums are combined by one all-reduce per distinct set of groups, so it is a
    collective: every rank of those groups calls it with the same kinds of parts, in the same order."""
    if not parts:
        return torch.zeros(0)
    infinite = math.isinf(norm_type)
    device = next((t.device for t, _ in parts if t is not None), torch.device("cpu"))
    powers = torch.zeros(len(parts), dtype=torch.float32, device=device)
    by_groups: dict[tuple[int, ...], tuple[tuple[Any, ...], list[int]]] = {}
    for i, (local, groups) in enumerate(parts):
        by_groups.setdefault(tuple(id(g) for g in groups), (groups, []))[1].append(i)
        if local is None or local.numel() == 0:
            continue
        value = local.detach().float().to(device)
        powers[i] = value.abs().max() if infinite else value.norm(norm_type) ** norm_type
    op = torch.distributed.ReduceOp.MAX if infinite else torch.distributed.ReduceOp.SUM
    for groups, indices in by_groups.values():
        if not groups:
            continue
        index = torch.tensor(indices, device=device)
        values = powers.index_select(0, index)
        for group in groups:
            torch.distributed.all_reduce(values, op=op, group=group)
        powers.index_copy_(0, index, values)
    return powers


def part_norms(parts: Sequence[tuple[torch.Tensor | None, tuple[Any, ...]]], norm_type: float) -> torch.Tensor:
    """The ``norm_type``-norm of each of several tensors held in parts across ranks: :func:`part_powers`' root."""
    powers = part_powers(parts, norm_type)
    return powers if math.isinf(norm_type) else powers ** (1.0 / norm_type)


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def auto_wrap_targets(module: nn.Module, min_params: int = 100_000) -> list[nn.Module]:
    """The submodules to shard as separate units, innermost-first, so each is gathered on its own.

    Rule, in order:

    1. *Repeated blocks*: children of one container (``ModuleList``/``Sequential``/``ModuleDict``) whose
       class occurs at least twice among that container's children, holding at least ``min_params``
       parameters each, e.g. the transformer blocks of a GPT (the outermost such children win).
    2. Otherwise, *large submodules*: the outermost submodules (below the root) with at least
       ``min_params`` parameters whose children are all below it.

    The root is never returned: the caller shards it last, catching the remaining parameters.

    A submodule holding a parameter that a module outside it also holds (tied weights: an LM head sharing the
    token embedding, as GPT-2, T5 and most language models do) is never a unit of its own: a parameter can
    belong to one sharding unit only, so tied weights stay together in the enclosing unit (the root).
    """
    shared = _shares_outside(module)
    blocks: list[nn.Module] = []
    for parent in module.modules():
        if isinstance(parent, _CONTAINERS):
            children = [c for c in parent.children() if not isinstance(c, _CONTAINERS)]
            counts = Counter(type(c) for c in children)
            blocks += [c for c in children if counts[type(c)] >= 2 and _num_params(c) >= min_params]
    blocks = [b for b in blocks if not shared(b)]
    if blocks:
        return _outermost(blocks)
    large = [
        m
        for m in module.modules()
        if m is not module
        and not isinstance(m, _CONTAINERS)
        and _num_params(m) >= min_params
        and all(_num_params(c) < min_params for c in m.children())
        and not shared(m)
    ]
    return _outermost(large)


def _shares_outside(root: nn.Module) -> Callable[[nn.Module], bool]:
    """A test: does a submodule hold a parameter that some module outside its subtree holds too?"""
    holders: dict[int, list[nn.Module]] = {}
    for m in root.modules():
        for p in m._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(m)
    tied = {pid for pid, ms in holders.items() if len(ms) > 1}
    if not tied:
        return lambda m: False

    def shared(module: nn.Module) -> bool:
        inside = {id(m) for m in module.modules()}
        return any(any(id(h) not in inside for h in holders[id(p)]) for p in module.parameters() if id(p) in tied)

    return shared


def _outermost(candidates: list[nn.Module]) -> list[nn.Module]:
    """Drop candidates nested inside another candidate (units must not overlap)."""
    inside: set[int] = set()
    for m in candidates:
        for sub in m.modules():
            if sub is not m:
                inside.add(id(sub))
    return [m for m in candidates if id(m) not in inside]


def is_fully_sharded(module: nn.Module) -> bool:
    """True if FSDP2's ``fully_shard`` was applied to ``module`` or any submodule (by the user's
    ``configure_model`` or an earlier run). Unlike checking for DTensor parameters, this stays true
    while FSDP2 holds parameters unsharded between forward and backward."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


#: torch's normalization layers: a few weights per channel, which mixed precision keeps in fp32 (ZeRO-1/2's fp32
#: buckets) or matches to their input's dtype (:func:`cast_norm_inputs_`).
NORM_LAYERS: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.modules.batchnorm._NormBase)


def shard_module_(
    module: nn.Module,
    mesh: object,
    *,
    reshard_after_forward: bool,
    targets: Iterable[nn.Module],
    mp_policy: object | None = None,
    offload_policy: object | None = None,
    async_prefetch: bool = False,
) -> nn.Module:
    """Apply FSDP2 ``fully_shard`` to each target, then to the root, in place.

    Args:
        module: The root module; its class changes to FSDP2's subclass of it.
        mesh: 1-D device mesh over the data-parallel ranks.
        reshard_after_forward: Free gathered parameters after forward (ZeRO-3) or keep them for backward.
        targets: Units from :func:`auto_wrap_targets` (or the user's choice).
        mp_policy: ``torch.distributed.fsdp.MixedPrecisionPolicy`` or None.
        offload_policy: ``torch.distributed.fsdp.CPUOffloadPolicy`` or None.
        async_prefetch: Prefetch neighbouring units with asynchronous all-gathers (for backends
            without CUDA streams, where FSDP2 otherwise overlaps no communication).
    """
    from torch.distributed.fsdp import OffloadPolicy, fully_shard

    kwargs: dict[str, object] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    kwargs["offload_policy"] = offload_policy if offload_policy is not None else OffloadPolicy()
    units = list(targets)
    if getattr(mp_policy, "param_dtype", None) is not None:
        # Batch norms keep fp32 parameters, each a unit of its own gathered in fp32 and kept gathered from forward to
        # backward (a few weights per channel), as FSDP1's MixedPrecision kept them: a 16-bit weight met the fp32
        # running statistics ("expected scalar type BFloat16 but found Float"). Other norms stay in their block's
        # unit (a unit inside a block breaks a compiled block's graph at its hooks): see `cast_norm_inputs_`.
        from dataclasses import replace

        fp32 = {**kwargs, "mp_policy": replace(mp_policy, param_dtype=None), "reshard_after_forward": False}  # type: ignore[type-var]
        for norm in module.modules():
            affine = isinstance(norm, nn.modules.batchnorm._NormBase) and norm.weight is not None
            if affine and norm is not module and not any(norm is u for u in units):
                fully_shard(norm, **fp32)  # type: ignore[call-overload]
    for target in units:
        fully_shard(target, **kwargs)  # type: ignore[call-overload]
    fully_shard(module, **kwargs)  # type: ignore[call-overload]
    if async_prefetch and len(units) > 1:
        _prefetch_neighbours(module, units)
    return module


def cast_norm_inputs_(module: nn.Module) -> list[Any]:
    """Give each of torch's normalization layers with a weight (layer, group, RMS, batch norm) a forward pre-hook
    that casts its floating inputs to its weight's dtype when that is 16-bit; returns the hook handles (remove them
    when the layout that needed them ends). For a module whose weights are gathered or held in 16 bits while
    activations may be fp32 (FSDP2's policy with the units' inputs left to autocast, DeepSpeed's 16-bit engine):
    autocast leaves CPU's norms alone, which refuse an fp32 input with a 16-bit weight ("mixed dtype (CPU): expect
    parameter to have scalar type of Float"). The hook is plain Python, so a compiled block traces through it."""

    def cast(norm: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        weight = getattr(norm, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype not in (torch.bfloat16, torch.float16):
            return args  # an fp32 weight takes a 16-bit input as it is (as under autocast with DDP)
        dtype = weight.dtype
        return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != dtype
                     else a for a in args)  # fmt: skip

    return [m.register_forward_pre_hook(cast) for m in module.modules()
            if isinstance(m, NORM_LAYERS) and getattr(m, "weight", None) is not None]  # fmt: skip


def shard_like_(copy: nn.Module, reference: nn.Module) -> int:
    """Lay each parameter of ``copy`` out as the parameter of the same name in ``reference``: where that one is a
    DTensor shard, ``copy``'s becomes a DTensor on the same mesh and placements holding a clone of this rank's part of
    ``reference``'s values (so ``copy`` holds 1/N of itself per rank, and element-wise arithmetic between the two runs
    locally). Parameters stay frozen or trainable as they were; tied parameters stay tied. ``copy`` must have
    ``reference``'s parameter names (a ``deepcopy`` of it, made before it was sharded). Returns how many were laid
    out; buffers are left alone (FSDP2 keeps them whole).

    For the copies a callback keeps of the module (Lightning's ``WeightAveraging``: an exponential moving average),
    which would otherwise stay whole on every rank and meet the sharded module's DTensors in mixed arithmetic.

    Raises:
        ValueError: ``copy`` has a parameter ``reference`` does not (their structures differ).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    ours = dict(reference.named_parameters(remove_duplicate=False))
    made: dict[int, nn.Parameter] = {}
    count = 0
    for name, param in list(copy.named_parameters(remove_duplicate=False)):
        target = ours.get(name)
        if target is None:
            raise ValueError(f"shard_like_: the copy's parameter `{name}` is not in the reference module")
        if not isinstance(target, DTensor):
            continue
        new = made.get(id(param))
        if new is None:
            if param.is_meta or param.shape != target.shape:
                # (a copy of a module built on the meta device: the values are the materialized module's)
                local = target.to_local().detach().to(param.dtype, copy=True)
                value = DTensor.from_local(
                    local,
                    target.device_mesh,
                    target.placements,
                    run_check=False,
                    shape=target.shape,
                    stride=target.stride(),
                )
            else:
                # The copy's own values and dtype, cut as the module is (no communication): an fp32 average of a
                # bf16 module (BF16Precision) stays fp32 (it became bf16, where increments below half a bf16 step
                # of an average are lost).
                value = distribute_tensor(
                    param.detach().to(target.device), target.device_mesh, target.placements, src_data_rank=None
                )
            new = made[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            count += 1
        owner, _, leaf = name.rpartition(".")
        setattr(copy.get_submodule(owner) if owner else copy, leaf, new)
    return count


def regather_root_in_step_(root: nn.Module) -> list[Any]:
    """Manual optimization on a sharded root: gather the root unit's parameters again whenever a module holding
    some of them runs (a forward pre-hook on each; gathering is a no-op while they are gathered). Returns the hook
    handles.

    The strategy runs a step through the root's call, so FSDP2 gathers the root's own parameters (those outside
    every unit: small leftover layers, tied embeddings) once, at the step's start. With manual optimization a step
    may run backward and step the optimizer and then call the modules again (a GAN's generator phase after its
    discriminator's, ``manual_backward`` per micro-batch): backward reshards the root unit, and a later call of a
    module it holds directly (not through the root's own ``forward``) would meet the sharded parameters. After each
    optimizer step the caller reshards the root (:meth:`FSDPModule.reshard`), so that a module called next gathers
    the stepped values, never a stale gathered copy.
    """
    from torch.distributed.fsdp import FSDPModule

    owners: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if m is not root and next(m.parameters(recurse=False), None) is not None:
            owners.append(m)
        for child in m.children():
            if not isinstance(child, FSDPModule):
                visit(child)

    visit(root)

    def gather(module: nn.Module, args: Any) -> None:
        root.unshard()  # type: ignore[operator]

    return [m.register_forward_pre_hook(gather) for m in owners]


def _prefetch_neighbours(root: nn.Module, units: list[nn.Module]) -> None:
    """Issue each unit's all-gather asynchronously while its neighbour computes.

    Without CUDA streams (CPU, gloo), FSDP2 overlaps nothing by default: the pre-forward and
    pre-backward all-gathers block. Explicit prefetch of the next unit in forward (the previous in
    backward) with ``async_op=True`` lets gloo's thread move the bytes while this unit computes.
    Units are assumed to run in registration order (true of repeated blocks in a container).
    """
    for current, following in itertools.pairwise(units):
        current.set_modules_to_forward_prefetch([following])  # type: ignore[operator]
        following.set_modules_to_backward_prefetch([current])  # type: ignore[operator]
    root._set_unshard_async_op(True)  # type: ignore[operator]


class CommCounter:
    """Bytes this rank sent through FSDP2's collectives, cumulative.

    Counted as a ring moves them: an all-gather sends (N-1)/N of its gathered output, a reduce-scatter
    (N-1)/N of its input; the same accounting as FlatShardedOptimizer's ``comm_bytes``.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.bytes = 0

    def add(self, tensor: torch.Tensor, group: Any = None) -> None:
        """Count one collective over ``group`` (its size; None: ``world_size``, the whole world)."""
        n = self.world_size if group is None else torch.distributed.get_world_size(group)
        self.bytes += (n - 1) * tensor.numel() * tensor.element_size() // n


def count_comm_(module: nn.Module, counter: CommCounter) -> bool:
    """Route every FSDP2 unit's all-gathers and reduce-scatters through torch's default collectives,
    counted by ``counter``. The transport is unchanged (FSDP2's ``set_custom_all_gather`` /
    ``set_custom_reduce_scatter`` with subclasses of its own defaults). Returns False, counting nothing,
    when this torch has no such hooks."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
    except ImportError:
        return False

    class CountingAllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            counter.add(output_tensor, group)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            counter.add(input_tensor, group)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units or not hasattr(units[0], "set_custom_all_gather"):
        return False
    for unit in units:
        unit.set_custom_all_gather(CountingAllGather())
        unit.set_custom_reduce_scatter(CountingReduceScatter())
    return True
