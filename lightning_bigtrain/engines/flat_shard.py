"""ZeRO stages 1 and 2 as a flat-partition optimizer wrapper (Rajbhandari et al., 2020): replicated
parameters; sharded optimizer states ("P_os", stage 1) and optionally sharded gradients ("P_os+g", stage 2).

Every parameter group's trainable parameters are laid out in flat buckets (each padded to a multiple of
the world size) and become views into them; so do their gradients. Rank ``r`` owns slice ``r`` of every
bucket. During backward, each bucket is reduce-scattered in place as soon as its gradients are complete
(overlapping the rest of backward); the user's optimizer, rebuilt over the owned slices, updates them;
in-place all-gathers return the updated parameters to every rank. Per step each rank sends 2(N-1)/N of
the gradient bytes, as a ring all-reduce would. With fp32 AdamW a rank holds (8 + 8/N) bytes per
parameter at stage 1 (4 + 4 + 8/N) and (4 + 12/N) at stage 2, where only its slice of the reduced
gradients is kept (the ZeRO paper's formulas).

With a gradient compressor, stage 2's reduce-scatter is a compressed one (each rank's slice compressed for that
rank alone, error feedback on each rank's whole local gradient: one more fp32 gradient copy per rank, 4 bytes per
parameter, counted in the model-state bytes); see :meth:`GradientCompression.reduce_scatter`.

Mixed precision (``param_dtype=torch.bfloat16`` or ``torch.float16``) is the paper's layout: the replicated
parameters and the gradient buckets are 16-bit, and each rank keeps the fp32 master copy of its slice in the
optimizer state (key ``"master"``), steps it with fp32 gradients made for the step, and all-gathers the
16-bit parameters: (2 + 2 + K/N) bytes per parameter at stage 1 and (2 + (2 + K)/N) at stage 2, K = 12 for
Adam (fp32 master, momentum and variance). 16-bit buckets are divided by N before they are summed.

Slices are exposed to the optimizer as 1-D ``DTensor`` shards of their bucket, so gradient
clipping by norm (``torch.nn.utils.clip_grad_norm_``) computes the true global norm, and
``torch.distributed.checkpoint`` saves and reshards the optimizer state across world sizes.

Limitation: an optimizer whose update depends on a parameter's shape or whole-tensor statistics
(LAMB, Adafactor, Shampoo, Muon, ...) sees flat partitions instead; only element-wise optimizers
are accepted, and only those that can step DTensor slices: both asked of the optimizer itself at construction
(:mod:`~lightning_bigtrain.functional.optim_probe`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Collection, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_bigtrain.functional.optim_probe import (
    ELEMENTWISE_OPTIMIZERS,
    dtensor_step_error,
    rebuild_optimizer,
    slice_step_error,
)
from lightning_bigtrain.functional.sharding import NORM_LAYERS, local_view

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "FlatGradScaler",
    "FlatShardedOptimizer",
    "bucket_runs",
    "flat_grad_part",
    "norm_parameters",
]


def _all_gather(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    """Newer torch names it ``all_gather_single`` and deprecates ``all_gather_into_tensor`` (same signature).
    Looked up per call, so that wrappers installed on torch.distributed (byte counters) see it."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(output, input, **kwargs)


def _reduce_scatter(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
    """``reduce_scatter_single`` where torch has it, else ``reduce_scatter_tensor`` (same signature)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(output, input, **kwargs)


def written_over(master: torch.Tensor, replica: torch.Tensor) -> torch.Tensor:
    """Mixed precision: the fp32 weights a 16-bit replica stands for. Where the replica is the master's rounding,
    the master (its fp32 precision); elsewhere something wrote into the replica after the master's last step (a
    pruning mask, a user's clamp), and the written value stands, as it would have in fp32 parameters. (A write of the
    value the replica already held, the master's rounding, cannot be told from none: the master stays, within half a
    16-bit step of it.)"""
    return torch.where(replica == master.to(replica.dtype), master, replica.to(master.dtype))


def norm_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of torch's normalization layers (LayerNorm, GroupNorm, RMSNorm, BatchNorm, InstanceNorm), which
    mixed precision keeps in fp32: a few per channel, and 16-bit weights there would meet fp32 inputs or running
    statistics in ops that autocast does not cast (CPU's layer norm, batch norm)."""
    return [p for m in module.modules() if isinstance(m, NORM_LAYERS) for p in m.parameters(recurse=False)]


def bucket_runs(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Split ``params`` (one dtype) into buckets of about ``bucket_bytes``, in reverse order (backward produces
    gradients roughly last layer first). Each bucket is then padded to a multiple of the world size."""
    runs: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        if runs[-1] and size + p.numel() * p.element_size() > bucket_bytes:
            runs.append([])
            size = 0
        runs[-1].append(p)
        size += p.numel() * p.element_size()
    return runs


_STAGED = 2  # stage 2: staging buffers alive at once


#: Each bucketed parameter's engine, bucket and position in it, by ``id`` (with weak references to the parameter, so a
#: reused id is not mistaken for it, and to the engine, so this table never keeps an engine's buffers alive): how
#: :func:`flat_grad_part` finds a parameter's part of the averaged gradient from the parameter alone.
_OWNERS: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[FlatShardedOptimizer], int, int]] = {}


def flat_grad_part(param: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
    """``param``'s part of the averaged gradient on this rank and the process group whose ranks hold the other parts,
    where a :class:`FlatShardedOptimizer` holds it (else None): the gradient its optimizer steps, between the end of
    a synchronised backward pass and the step. ``param.grad`` is not that gradient there (stage 1: averaged only in
    this rank's slices, zero in the others; stage 2: None outside backward). Empty where this rank owns none of it."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    engine = entry[1]()
    if engine is None:
        return None
    b, index = engine._buckets[entry[2]], entry[3]
    lo = engine.rank * b.chunk
    local = b.grad[lo : lo + b.chunk] if b.grad is not None else b.shard_grad
    assert local is not None
    start, n = b.offsets[index], b.params[index].numel()
    a, z = max(start, lo), min(start + n, lo + b.chunk)
    return local[a - lo : z - lo] if a < z else local[:0], engine.group


_NAMED: dict[type, type[FlatShardedOptimizer]] = {}


def _named_after(inner: type) -> type[FlatShardedOptimizer]:
    """The subclass of :class:`FlatShardedOptimizer` named as ``inner`` (one per optimizer class, so that two wrapped
    AdamWs are one type, as Lightning's ``lr-AdamW`` and ``lr-AdamW-1`` count them)."""
    named = _NAMED.get(inner)
    if named is None:
        attrs = {"__module__": __name__, "__qualname__": f"FlatShardedOptimizer[{inner.__qualname__}]"}
        named = _NAMED[inner] = type(inner.__name__, (FlatShardedOptimizer,), attrs)
    return named


def _from_local(local: torch.Tensor, mesh: Any, numel: int) -> Any:
    """``local`` as this rank's 1-D shard of a ``numel``-long DTensor over ``mesh``."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((numel,)), stride=(1,))


@dataclass
class _Bucket:
    """A contiguous run of parameters in one flat buffer, padded to a multiple of the world size."""

    params: list[nn.Parameter]
    flat: torch.Tensor  # padded parameters (a view into the group buffer), every rank
    grad: torch.Tensor | None  # stage 1: padded gradients (a view into the group buffer), every rank
    numel: int  # unpadded
    chunk: int  # partition length (padded size / world size)
    offsets: list[int]  # where each parameter starts in the bucket
    shard_grad: torch.Tensor | None = None  # stage 2: this rank's reduced gradient slice (persistent)
    staging: torch.Tensor | None = None  # stage 2: the bucket's gradients during one backward pass
    pending: int = 0  # parameters whose gradient has not arrived in this backward pass
    work: Any = None  # the in-flight reduce-scatter
    master: torch.Tensor | None = None  # mixed precision: this rank's fp32 slice (padded to ``chunk``)
    predivided: bool = False  # the reduced buffer was divided by the world size before the sum
    done: bool = False  # reduced in this backward pass (and, at stage 2, its staging buffer released)
    reduced: bool = False  # stage 1: this rank's slice holds averaged gradients (no zero_grad since)
    carry: torch.Tensor | None = None  # stage 1: those averaged gradients, set aside while the next backward runs
    seen_version: int = -1  # mixed precision: ``flat``'s version counter after the last all-gather (in-place writes)


class FlatShardedOptimizer(torch.optim.Optimizer):
    """Wraps a user's optimizer so its states (ZeRO-1), and optionally its gradients (ZeRO-2), live only
    on the partition each rank owns.

    Parameters are grouped into buckets of about ``bucket_bytes`` (in reverse order of registration, the
    order in which backward produces gradients); rank ``r`` owns the ``r``-th slice of every bucket. A
    bucket's reduce-scatter starts as soon as its last gradient arrives, overlapping communication with
    the rest of backward, as DDP does with its all-reduce.

    With ``shard_gradients=True`` (stage 2) no full gradient buffer is kept: each parameter's gradient is
    copied into its bucket's staging buffer as soon as autograd produces it and then freed; the staging
    buffer is reduce-scattered and released, and only this rank's slice of the averaged gradient stays
    (accumulating over micro-batches). ``param.grad`` is then None outside backward: read gradients from
    the optimizer's (DTensor) parameters instead.

    Args:
        optimizer: The optimizer from ``configure_optimizers`` (its parameters, groups and
            hyper-parameters are taken over; it is not stepped itself).
        mesh: 1-D device mesh over the data-parallel ranks.
        bucket_bytes: Target bucket size.
        shard_gradients: Keep only this rank's slice of the gradients (ZeRO-2).
        compression: A :class:`~lightning_bigtrain.engines.compression.GradientCompression` engine. Stage 1: it
            averages each gradient bucket (compressed all-reduce) instead of the reduce-scatter. Stage 2 (an engine
            made with ``sharded=True``): each bucket's reduce-scatter is its compressed one
            (:meth:`~lightning_bigtrain.engines.compression.GradientCompression.reduce_scatter`), error feedback
            kept per rank on its whole local gradient.
        reduce_dtype: Stage 2: reduce-scatter the gradients in this lower precision (``torch.float16`` or
            ``torch.bfloat16``), divided by the world size first; the kept slice stays in the parameters' dtype.
        param_dtype: Mixed precision: hold the replicated parameters and the gradient buckets in this 16-bit
            dtype (``torch.bfloat16`` or ``torch.float16``), the fp32 master slices in the optimizer state
            (``"master"``). The optimizer's parameters are then the 16-bit slices (what clipping and a loss
            scaler see); the wrapped optimizer steps the masters with fp32 copies of their gradients.
        keep_fp32: With ``param_dtype``: parameters left in fp32, in fp32 buckets of their own (the strategy
            passes :func:`norm_parameters`).

    Raises:
        TypeError: The optimizer is not element-wise, or cannot be rebuilt from its ``defaults``.

    An instance is of a subclass named as the wrapped optimizer's class (``type(flat).__name__ == "AdamW"``,
    ``__qualname__`` ``FlatShardedOptimizer[AdamW]``): what Lightning names it by, in ``LearningRateMonitor``'s
    ``lr-AdamW`` (it logged ``lr-FlatShardedOptimizer`` under stages 1-2, another metric than under DDP).
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> FlatShardedOptimizer:
        if cls is FlatShardedOptimizer:
            cls = _named_after(type(optimizer))
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        mesh: Any,
        bucket_bytes: int = 25 * 2**20,
        shard_gradients: bool = False,
        compression: Any = None,
        reduce_dtype: torch.dtype | None = None,
        param_dtype: torch.dtype | None = None,
        keep_fp32: Collection[nn.Parameter] = (),
    ) -> None:
        self.stage = 2 if shard_gradients else 1
        if param_dtype not in (None, torch.float16, torch.bfloat16):
            raise ValueError(
                f"`FlatShardedOptimizer(param_dtype={param_dtype})`: mixed precision holds parameters in "
                "torch.bfloat16 or torch.float16 (None keeps the parameters' own dtype)."
            )
        if param_dtype is not None and compression is not None:
            raise ValueError("`FlatShardedOptimizer(param_dtype=...)` cannot be combined with `compression=`.")
        reason = slice_step_error(optimizer)
        if reason is not None:
            name = type(optimizer).__name__
            names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            stage3 = dtensor_step_error(optimizer, mesh) is None
            raise TypeError(
                f"`ZeroStrategy(stage={self.stage})` cannot shard {name}: stage {self.stage} hands each rank a flat "
                f"slice of the parameters, which is only correct for an element-wise optimizer, and {reason}. Use "
                + ("stage=3 (each parameter sharded whole-shaped, as a DTensor, which it can step), " if stage3 else "")
                + f"Lightning's DDP (whole parameters on every rank), or an element-wise optimizer ({names}, ...)."
            )
        failure = dtensor_step_error(optimizer, mesh, flat=True)
        if failure is not None:
            raise TypeError(
                f"`ZeroStrategy(stage={self.stage})` cannot shard {type(optimizer).__name__}: stage {self.stage} hands "
                "it its slices as DTensors (so that clipping sees the global norm and checkpoints reshard), and it "
                f"cannot step them ({failure}). Use `DeepSpeedZeroStrategy(stage={self.stage})` (plain flat "
                "partitions) or Lightning's DDP."
            )
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if compression is not None and bool(shard_gradients) != bool(getattr(compression, "sharded", False)):
            raise ValueError(
                "`FlatShardedOptimizer(compression=...)`: stage 2 (shard_gradients=True) needs an engine made with "
                "`GradientCompression(..., sharded=True)` (a compressed reduce-scatter), stage 1 one without."
            )
        self.compression = compression  # a GradientCompression engine: stage 1's gradients are all-reduced by it
        self.reduce_dtype = reduce_dtype  # stage 2: reduce-scatter in this (lower) precision
        self.require_sync = True
        self.comm_bytes = 0  # bytes this rank sent in collectives, cumulative (the compression engine counts its own)
        self._buckets: list[_Bucket] = []
        self._in_flight: list[_Bucket] = []  # stage 2: buckets whose reduce-scatter has not been waited for
        self._shards: list[list[nn.Parameter]] = []  # per group: the slices the optimizer's groups show
        self._pairs: list[tuple[_Bucket, nn.Parameter, nn.Parameter]] = []  # (bucket, its slice, what is stepped)
        #: The user's optimizer's parameters per group, in order (frozen ones included): what a plain optimizer's
        #: state is keyed by (positions), for resuming a checkpoint written by one.
        self.group_params: list[list[torch.Tensor]] = [list(g["params"]) for g in optimizer.param_groups]
        inner_groups = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            hyper = {k: v for k, v in group.items() if k != "params"}
            if not params:
                continue
            dtypes = {p.dtype for p in params}
            if len(dtypes) != 1:
                raise TypeError(
                    f"`ZeroStrategy(stage={self.stage})`: a parameter group mixes dtypes {sorted(map(str, dtypes))}; "
                    "put parameters of different dtypes into different groups."
                )
            if param_dtype is not None and params[0].dtype != torch.float32:
                raise TypeError(
                    f"`ZeroStrategy(stage={self.stage})` in mixed precision keeps fp32 master copies of fp32 "
                    f"parameters; this group's are {params[0].dtype}. Leave the parameters in fp32 (the "
                    "strategy holds them in 16 bits itself)."
                )
            kept = {id(p) for p in keep_fp32} if param_dtype is not None else set()
            buckets = self._flatten([p for p in params if id(p) not in kept], bucket_bytes, param_dtype)
            buckets += self._flatten([p for p in params if id(p) in kept], bucket_bytes, None)
            shards, masters = [], []
            for b in buckets:
                lo = min(self.rank * b.chunk, b.numel)
                hi = min(lo + b.chunk, b.numel)
                shard = nn.Parameter(_from_local(b.flat[lo:hi], mesh, b.numel))
                local_grad = b.grad[lo:hi] if b.grad is not None else b.shard_grad[: hi - lo]  # type: ignore[index]
                shard.grad = _from_local(local_grad, mesh, b.numel)
                shards.append(shard)
                # What the optimizer steps: the fp32 master of a 16-bit bucket, else the slice itself.
                master = shard if b.master is None else nn.Parameter(_from_local(b.master[: hi - lo], mesh, b.numel))
                masters.append(master)
                self._pairs.append((b, shard, master))
            self._buckets += buckets
            inner_groups.append({**hyper, "params": masters})
            self._shards.append(shards)
        try:
            self.inner = rebuild_optimizer(optimizer, inner_groups)
        except TypeError as err:
            raise TypeError(
                f"`ZeroStrategy(stage={self.stage})` could not rebuild {type(optimizer).__name__} "
                f"from its defaults: {err}"
            ) from err
        super().__init__([torch.zeros(0)], dict(optimizer.defaults))
        # Share the inner optimizer's groups and state so schedulers and checkpoints act on the shards. In mixed
        # precision the groups show the 16-bit slices (clipping and loss scaling act on their gradients); the
        # inner optimizer sees its fp32 masters only inside `_stepping_masters`.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._masters = [list(group["params"]) for group in self.inner.param_groups]
        self._mixed = any(b.master is not None for b in self._buckets)
        if self._mixed:
            for group, shards in zip(self.inner.param_groups, self._shards, strict=True):
                group["params"] = shards
        self._queued = False
        self._reset_pending()
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda param, b=b, i=i: self._on_grad_ready(b, i, param))
            for b in self._buckets
            for i, p in enumerate(b.params)
        ]
        for k, b in enumerate(self._buckets):
            for i, p in enumerate(b.params):
                _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(self), k, i)

    def remove_hooks(self) -> None:
        """Detach from the parameters (their post-accumulate-grad hooks): when the run that built this engine ends.
        A second engine over the same module (``trainer.fit`` again, after ``lr_find``, or another Trainer) would
        otherwise run behind this one's hooks: at stage 2 they took each gradient first and the new engine failed
        on an assertion at the first backward; at stage 1 every gradient was reduced twice."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for b in self._buckets:
            for p in b.params:
                entry = _OWNERS.get(id(p))
                if entry is not None and entry[1]() is self:
                    del _OWNERS[id(p)]

    def _reset_pending(self) -> None:
        for b in self._buckets:
            b.pending = len(b.params)

    def _on_grad_ready(self, bucket: _Bucket, index: int, param: torch.Tensor) -> None:
        if self.stage == 2:
            # Move the gradient into the bucket's staging buffer and free it (stage 2 reduces every
            # backward pass, accumulation included, and keeps only the reduced slice).
            if bucket.staging is None:
                bucket.staging = torch.zeros_like(bucket.flat)
            offset = bucket.offsets[index]
            assert param.grad is not None
            bucket.staging[offset : offset + param.numel()].copy_(param.grad.reshape(-1))
            param.grad = None
        elif not self.require_sync:
            return
        if not self._queued:
            # Finish once the whole backward pass is done (as DDP finalizes its buckets), so that clipping
            # and `on_before_optimizer_step` already see the averaged partitions.
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start_reduce(bucket)

    def _buffer(self, b: _Bucket) -> torch.Tensor:
        if b.grad is not None:
            return b.grad
        if b.staging is None:  # no gradient reached this bucket (unused parameters): contribute zeros
            b.staging = torch.zeros_like(b.flat)
        return b.staging

    def _start_reduce(self, b: _Bucket) -> None:
        buffer = self._buffer(b)
        if self.compression is not None and b.grad is not None:
            b.work = self.compression.exchange(buffer, self.compression.segments(buffer, b.params, b.offsets))
            return
        if self.compression is not None:  # stage 2: a compressed reduce-scatter; the future's value is the slice
            b.work = self.compression.reduce_scatter(buffer, b.params, b.offsets, b.chunk)
            self._bound_staging(b)
            return
        b.predivided = False
        if self.reduce_dtype is not None and buffer.dtype != self.reduce_dtype:
            # Pre-divided, as torch's fp16 hook does, so the low-precision sum stays in range.
            buffer = b.staging = buffer.div(self.world).to(self.reduce_dtype)
            b.predivided = True
        elif b.master is not None:
            buffer.div_(self.world)  # 16-bit buckets: divided before the sum too
            b.predivided = True
        mine = buffer[self.rank * b.chunk : (self.rank + 1) * b.chunk]
        b.work = _reduce_scatter(mine, buffer, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.comm_bytes += (self.world - 1) * mine.numel() * mine.element_size()
        if b.grad is None:
            self._bound_staging(b)

    def _bound_staging(self, b: _Bucket) -> None:
        """Stage 2: at most _STAGED buckets' staging buffers alive at once (one being reduced while the next fills);
        without the bound every bucket's stayed until backward ended, a full gradient copy."""
        self._in_flight.append(b)
        while len(self._in_flight) > _STAGED:
            self._finish(self._in_flight.pop(0))

    def _on_backward_end(self) -> None:
        self._queued = False
        self.reduce_gradients()

    def _flatten(self, params: list[nn.Parameter], bucket_bytes: int, dtype: torch.dtype | None) -> list[_Bucket]:
        """Lay ``params`` out in one buffer of padded buckets; parameters and gradients become views. With a 16-bit
        ``dtype`` the buffer is in that dtype and each bucket keeps this rank's fp32 master slice."""
        if not params:
            return []
        runs = bucket_runs(params, bucket_bytes)
        chunks = [math.ceil(sum(p.numel() for p in run) / self.world) for run in runs]
        first = params[0]
        mixed = dtype is not None and dtype != first.dtype
        src = dist.get_global_rank(self.group, 0)
        flat = torch.zeros(sum(chunks) * self.world, dtype=dtype or first.dtype, device=first.device)
        grad = torch.zeros_like(flat) if self.stage == 1 else None
        buckets, start = [], 0
        for run, chunk in zip(runs, chunks, strict=True):
            padded = chunk * self.world
            b = _Bucket(run, flat[start : start + padded], None, 0, chunk, [])
            if grad is not None:
                b.grad = grad[start : start + padded]
            else:
                b.shard_grad = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
            lo = self.rank * chunk
            if mixed:
                b.master = torch.zeros(chunk, dtype=first.dtype, device=first.device)
            offset = 0
            for p in run:
                n = p.numel()
                b.offsets.append(offset)
                values = p.detach().reshape(-1)
                if mixed:
                    # Rank 0's fp32 values: this rank's master slice is taken before they are rounded to 16 bits.
                    values = values.clone()
                    dist.broadcast(values, src=src, group=self.group)
                    a, z = max(offset, lo), min(offset + n, lo + chunk)
                    if a < z and b.master is not None:
                        b.master[a - lo : z - lo].copy_(values[a - offset : z - offset])
                b.flat[offset : offset + n].copy_(values)
                p.data = b.flat[offset : offset + n].view_as(p)
                p.grad = b.grad[offset : offset + n].view_as(p) if b.grad is not None else None
                offset += n
            b.numel = offset
            buckets.append(b)
            start += padded
        if not mixed:
            # Start from rank 0's parameters everywhere, as DDP does.
            dist.broadcast(flat, src=src, group=self.group)
        return buckets

    @torch.no_grad()
    def _adopt_data(self) -> None:
        """A parameter whose ``.data`` was replaced (``p.data = t``: Lightning's ``ModelPruning`` resetting weights for
        the lottery ticket, a user's own re-initialization) is no longer a view into its bucket: the engine would go on
        stepping and gathering the bucket while the module computed with the new tensor, never updated (its weights
        silently frozen). Its values are taken into the bucket (and this rank's fp32 master slice) and the view
        restored."""
        for b in self._buckets:
            start, size = b.flat.data_ptr(), b.flat.element_size()
            lo = self.rank * b.chunk
            for p, offset in zip(b.params, b.offsets, strict=True):
                if p.data_ptr() == start + offset * size:
                    continue
                n = p.numel()
                values = p.detach().reshape(-1)
                if b.master is not None:
                    a, z = max(offset, lo), min(offset + n, lo + b.chunk)
                    if a < z:
                        b.master[a - lo : z - lo].copy_(values[a - offset : z - offset])
                b.flat[offset : offset + n].copy_(values)
                p.data = b.flat[offset : offset + n].view_as(p)

    @torch.no_grad()
    def _adopt_writes(self) -> None:
        """Mixed precision: values written in place into the module's parameters since the last step (a pruning
        mask, a user's clamp, a callback copying weights in) land in the 16-bit replicas only; the step would put the
        masters' rounding back over them (the mask undone, the pruned weights back in every checkpoint and in the
        module after fit). Where this rank's slice of the replicas is no longer its masters' rounding, the written
        value becomes the master (:func:`written_over`). Checked only where the buckets' version counter moved."""
        for b in self._buckets:
            if b.master is None or b.flat._version == b.seen_version:
                continue
            lo = self.rank * b.chunk
            b.master.copy_(written_over(b.master, b.flat[lo : lo + b.chunk]))

    @torch.no_grad()
    def _adopt_grads(self) -> None:
        """Stage 1: each parameter's ``.grad`` the view into its bucket again, with the value it had (None: zero)."""
        for b in self._buckets:
            if b.grad is None:
                continue
            start, size = b.grad.data_ptr(), b.grad.element_size()
            for p, offset in zip(b.params, b.offsets, strict=True):
                if p.grad is not None and p.grad.data_ptr() == start + offset * size:
                    continue  # the view already (every backward pass but the rare one): no tensor made
                view = b.grad[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def _restore_grad_views(self) -> None:
        for b in self._buckets:
            if b.grad is None:
                for p in b.params:
                    p.grad = None
                continue
            offset = 0
            for p in b.params:
                n = p.numel()
                view = b.grad[offset : offset + n].view_as(p)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
                offset += n

    def _finish(self, b: _Bucket) -> None:
        """Wait for ``b``'s reduce-scatter; average this rank's slice, zero the slices it does not own (stage 1), or
        add it to the kept gradient slice and release the staging buffer (stage 2)."""
        reduced = b.work.wait()
        b.work = None
        b.done = True
        lo, hi = self.rank * b.chunk, (self.rank + 1) * b.chunk
        if b.grad is None and self.compression is not None:  # stage 2, compressed: the slice comes averaged
            assert b.shard_grad is not None
            b.shard_grad.add_(reduced)
            b.staging = None
        elif b.grad is not None:
            if self.compression is None and not b.predivided:  # the compressed exchange averages itself
                b.grad[lo:hi].div_(self.world)
            b.grad[:lo].zero_()
            b.grad[hi:].zero_()
            if b.carry is not None:  # averaged gradients of earlier backward passes of this step
                b.grad[lo:hi].add_(b.carry)
                b.carry = None
            b.reduced = True
        else:
            assert b.staging is not None and b.shard_grad is not None
            if b.predivided:
                b.shard_grad.add_(b.staging[lo:hi].to(b.shard_grad.dtype))
            else:
                b.shard_grad.add_(b.staging[lo:hi], alpha=1.0 / self.world)
            b.staging = None

    def begin_backward(self) -> None:
        """Called before each backward pass (the strategy's ``backward``). Stage 1: a slice that already holds
        averaged gradients (a synchronised backward pass without ``zero_grad`` since: manual optimization that
        accumulates with ``manual_backward`` each micro-batch, as DDP allows) is set aside, so the next reduction
        averages only the new local gradients and adds it back. Reducing the sum instead would count it again on
        this rank and halve it in the average. Stage 2 keeps its reduced slice apart already.

        Stage 1 also puts back the gradient views that ``module.zero_grad()`` (Lightning calls it before every run;
        a user may too) replaced with ``None``: zeroed, so that this backward pass accumulates into the buckets. A
        gradient the user assigned is copied into its view."""
        self._adopt_data()
        self._adopt_grads()
        for b in self._buckets:
            if b.reduced and b.grad is not None:
                lo, hi = self.rank * b.chunk, (self.rank + 1) * b.chunk
                b.carry = b.grad[lo:hi].clone() if b.carry is None else b.carry.add_(b.grad[lo:hi])
                b.grad[lo:hi].zero_()
                b.reduced = False

    def _settle(self) -> None:
        """Stage 1: averaged gradients set aside by :meth:`begin_backward` whose backward pass was not
        synchronised (``no_sync``) go back into the slice before anything reads it (as with DDP, the local
        gradients of that pass are added to them unreduced)."""
        for b in self._buckets:
            if b.carry is not None and b.grad is not None:
                b.grad[self.rank * b.chunk : (self.rank + 1) * b.chunk].add_(b.carry)
                b.carry = None
                b.reduced = True

    def reduce_gradients(self) -> None:
        """Finish every bucket's reduce-scatter: average this rank's slices, zero the slices it does not own."""
        for b in self._buckets:
            if b.work is None and not b.done:
                self._start_reduce(b)  # parameters without gradients this pass (unused) or no hooks fired
        for b in self._buckets:
            if not b.done:
                self._finish(b)
        self._in_flight.clear()
        for b in self._buckets:
            b.done = False
        self._reset_pending()

    def gather_parameters(self) -> None:
        works = []
        for b in self._buckets:
            mine = b.flat[self.rank * b.chunk : (self.rank + 1) * b.chunk]
            works.append(_all_gather(b.flat, mine, group=self.group, async_op=True))
            self.comm_bytes += (self.world - 1) * mine.numel() * mine.element_size()
        for work in works:
            if work is not None:
                work.wait()
        for b in self._buckets:
            b.seen_version = b.flat._version

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adopt_data()
        self._adopt_writes()
        self._settle()
        if not self._mixed:
            self.inner.step()
        else:
            with self._stepping_masters(with_grads=True):
                self.inner.step()
            self._masters_to_replicas()
        self.gather_parameters()
        self._opt_called = True  # an LR scheduler re-bound to this wrapper checks it
        return loss

    def whole_masters(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Mixed precision: each 16-bit parameter with its fp32 master, whole (every bucket's slices all-gathered over
        the group: a collective, call it on every rank); empty without mixed precision. The tensors are views into
        one new buffer per bucket."""
        out = []
        for b in self._buckets:
            if b.master is None:
                continue
            whole = b.master.new_empty(b.chunk * self.world)
            _all_gather(whole, b.master, group=self.group)
            whole = written_over(whole, b.flat)  # what was written into the module since the last step stands
            out += [(p, whole[o : o + p.numel()].view(p.shape)) for p, o in zip(b.params, b.offsets, strict=True)]
        return out

    def master_parts(self) -> list[tuple[nn.Parameter, int, int, torch.Tensor]]:
        """Mixed precision: ``(param, start, stop, master)`` for every 16-bit parameter, ``master`` the fp32 values of
        its flattened elements ``[start, stop)`` this rank's master slice holds (``start == stop``: none of it). Read
        after a step, these are what the step made of them (local, no communication). Empty without mixed precision."""
        out = []
        for b in self._buckets:
            if b.master is None:
                continue
            lo = self.rank * b.chunk
            for p, offset in zip(b.params, b.offsets, strict=True):
                a, z = max(offset, lo), min(offset + p.numel(), lo + b.chunk)
                a = min(a, z)
                out.append((p, a - offset, z - offset, b.master[a - lo : z - lo]))
        return out

    @torch.no_grad()
    def gather_parts_(self, targets: dict[int, torch.Tensor]) -> None:
        """Mixed precision: for every 16-bit parameter ``p`` with a tensor of its shape in ``targets`` (keyed by
        ``id(p)``), the elements of ``p`` this rank's master slice covers are taken from this rank's tensor and
        all-gathered into every rank's: afterwards each target holds, everywhere, what its owners' held (a collective,
        one all-gather per bucket: call it on every rank). Parameters without a target contribute their masters."""
        for b in self._buckets:
            if b.master is None:
                continue
            lo = self.rank * b.chunk
            mine = b.master.to(b.flat.device, torch.float32, copy=True)
            for p, offset in zip(b.params, b.offsets, strict=True):
                target = targets.get(id(p))
                a, z = max(offset, lo), min(offset + p.numel(), lo + b.chunk)
                if target is not None and a < z:
                    mine[a - lo : z - lo].copy_(target.reshape(-1)[a - offset : z - offset])
            whole = mine.new_empty(b.chunk * self.world)
            _all_gather(whole, mine, group=self.group)
            for p, offset in zip(b.params, b.offsets, strict=True):
                target = targets.get(id(p))
                if target is not None:
                    target.copy_(whole[offset : offset + p.numel()].view(target.shape))

    @torch.no_grad()
    def write_whole_(self, values: dict[int, torch.Tensor]) -> None:
        """Mixed precision: whole fp32 values for 16-bit parameters (keyed by ``id(p)``; every rank passes the same)
        become their masters where this rank's slice covers them, and their 16-bit rounding the replicas: what an
        fp32 copy into the module is under DDP. A copy into the 16-bit parameters alone keeps only the rounding, which
        the next step (or the end of fit) then adopts as the masters. No communication."""
        for b in self._buckets:
            if b.master is None:
                continue
            lo = self.rank * b.chunk
            for p, offset in zip(b.params, b.offsets, strict=True):
                value = values.get(id(p))
                if value is None:
                    continue
                n = p.numel()
                whole = value.detach().reshape(-1).to(b.master.device, torch.float32)
                a, z = max(offset, lo), min(offset + n, lo + b.chunk)
                if a < z:
                    b.master[a - lo : z - lo].copy_(whole[a - offset : z - offset])
                b.flat[offset : offset + n].copy_(whole)

    def _masters_to_replicas(self) -> None:
        """The masters, rounded to 16 bits, into this rank's slice of the replicas (all-gathered afterwards)."""
        for b in self._buckets:
            if b.master is not None:
                lo = self.rank * b.chunk
                b.flat[lo : lo + b.chunk].copy_(b.master)

    @contextmanager
    def _stepping_masters(self, with_grads: bool = False) -> Generator[None, None, None]:
        """Mixed precision: the inner optimizer's groups hold the fp32 masters (with fp32 copies of the 16-bit
        gradient slices when ``with_grads``) for the duration; afterwards the 16-bit slices again, the fp32
        gradients freed, and each master recorded in its optimizer state as ``"master"``."""
        groups = self.inner.param_groups
        for group, masters in zip(groups, self._masters, strict=True):
            group["params"] = masters
        if with_grads:
            for _, shard, master in self._pairs:
                if master is not shard:
                    assert shard.grad is not None
                    master.grad = _from_local(local_view(shard.grad).float(), self.mesh, shard.numel())
        try:
            yield
        finally:
            # The inner optimizer's current groups: a `load_state_dict` inside the context replaced them (with copies
            # holding the masters), and the visible groups must be the 16-bit slices again (what the loss scaler
            # unscales and clipping measures; after a resume the first step saw fp32 masters without gradients).
            for group, shards in zip(self.inner.param_groups, self._shards, strict=True):
                group["params"] = shards
            for _, shard, master in self._pairs:
                if master is not shard:
                    master.grad = None
                    state = self.inner.state.get(master)
                    if state:
                        state["master"] = master

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the optimizer states without changing parameters (so a checkpoint can load into them)."""
        if self.inner.state:
            return
        lrs = [group["lr"] for group in self.inner.param_groups]
        for group in self.inner.param_groups:
            group["lr"] = 0.0
        self.zero_grad()
        if not self._mixed:
            self.inner.step()
        else:
            with self._stepping_masters(with_grads=True):
                self.inner.step()
        for group, lr in zip(self.inner.param_groups, lrs, strict=True):
            group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients are views into the flat buffers (stage 1) or owned slices (stage 2): zero, never drop.
        for b in self._buckets:
            (b.grad if b.grad is not None else b.shard_grad).zero_()  # type: ignore[union-attr]
            b.reduced, b.carry = False, None
        self._restore_grad_views()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's; in mixed precision each state also holds the fp32 master slice (``"master"``)."""
        if not self._mixed:
            return self.inner.state_dict()
        with self._stepping_masters():
            return self.inner.state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._mixed:
            self.inner.load_state_dict(state_dict)
        else:
            with self._stepping_masters():
                self.inner.load_state_dict(state_dict)
                for _, shard, master in self._pairs:
                    if master is shard:
                        continue
                    saved = self.inner.state[master].pop("master", None)
                    if saved is None:
                        raise KeyError(
                            "This ZeRO optimizer checkpoint has no fp32 master copies: it was written "
                            "without mixed precision. Resume it with the precision it was trained in."
                        )
                    local_view(master).copy_(local_view(saved))
            self._masters_to_replicas()  # the replicas follow the masters
            self.gather_parameters()
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def layout(self, module: nn.Module) -> list[list[tuple[list[str], int, tuple[int, ...]]]]:
        """Where each parameter lies in each bucket, by name: per bucket (the optimizer state's index), a list of
        ``(names, offset, shape)`` (a tied parameter has several names). Lets a consolidation rebuild fp32
        weights from the masters of a mixed-precision checkpoint."""
        names: dict[int, list[str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        return [
            [(names.get(id(p), []), offset, tuple(p.shape)) for p, offset in zip(b.params, b.offsets, strict=True)]
            for b in self._buckets
        ]


class FlatGradScaler(ShardedGradScaler):
    """Dynamic loss scaling (fp16) over :class:`FlatShardedOptimizer`'s 16-bit gradient slices.

    Each rank checks only its own slices for overflow; the found-inf flags are summed over ``process_group``
    (as torch's ``ShardedGradScaler`` does) so that every rank skips the same steps and lowers the scale alike.
    The slices are unscaled in place as local tensors (they are ``DTensor`` shards)."""

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        grad = local_view(param.grad)
                        by_dtype.setdefault(grad.dtype, []).append(grad)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return {found_inf.device: found_inf}
