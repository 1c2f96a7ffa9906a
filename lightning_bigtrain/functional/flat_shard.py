"""ZeRO stage 1 as a flat-partition optimizer wrapper: replicated parameters and gradients, sharded
optimizer states (Rajbhandari et al., 2020, "P_os").

Every parameter group's trainable parameters are laid out in one flat buffer (padded to a multiple of
the world size) and become views into it; so do their gradients. After backward, one in-place
reduce-scatter per group leaves each rank the averaged gradient of its contiguous partition; the user's
optimizer (rebuilt over the partitions) updates that partition; one in-place all-gather returns the
updated parameters to every rank. Per step each rank sends 2(N-1)/N of the gradient bytes, as a ring
all-reduce would, and holds (8 + 8/N) bytes per parameter with fp32 AdamW (4 + 4 + 8/N).

Partitions are exposed to the optimizer as 1-D ``DTensor`` shards of the flat group, so gradient
clipping by norm (``torch.nn.utils.clip_grad_norm_``) computes the true global norm, and
``torch.distributed.checkpoint`` saves and reshards the optimizer state across world sizes.

Limitation: an optimizer whose update depends on a parameter's shape or whole-tensor statistics
(LAMB, Adafactor, Shampoo, Muon, ...) sees flat partitions instead; only element-wise optimizers
are accepted (see ``ELEMENTWISE_OPTIMIZERS``).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ELEMENTWISE_OPTIMIZERS", "FlatShardedOptimizer"]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
)


@dataclass
class _FlatGroup:
    params: list[nn.Parameter]
    flat: torch.Tensor  # padded parameters, every rank
    grad: torch.Tensor  # padded gradients, every rank
    numel: int  # unpadded
    chunk: int  # padded partition length
    shard: nn.Parameter  # DTensor view of this rank's partition


class FlatShardedOptimizer(torch.optim.Optimizer):
    """Wraps a user's optimizer so its states live only on the partition each rank owns (ZeRO-1).

    Args:
        optimizer: The optimizer from ``configure_optimizers`` (its parameters, groups and
            hyper-parameters are taken over; it is not stepped itself).
        mesh: 1-D device mesh over the data-parallel ranks.

    Raises:
        TypeError: The optimizer is not element-wise, or cannot be rebuilt from its ``defaults``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mesh: Any) -> None:
        from torch.distributed.tensor import DTensor, Shard

        if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
            names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            raise TypeError(
                f"`ZeroStrategy(stage=1)` cannot shard {type(optimizer).__name__}: stage 1 hands each rank a flat "
                f"slice of the parameters, which is only correct for element-wise optimizers ({names}). "
                "Use stage=2 or 3 (per-parameter sharding) or one of these optimizers."
            )
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.require_sync = True
        self.comm_bytes = 0  # bytes this rank sent in collectives, cumulative
        self._groups: list[_FlatGroup] = []
        inner_groups = []
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            hyper = {k: v for k, v in group.items() if k != "params"}
            if not params:
                continue
            dtypes = {p.dtype for p in params}
            if len(dtypes) != 1:
                raise TypeError(
                    f"`ZeroStrategy(stage=1)`: a parameter group mixes dtypes {sorted(map(str, dtypes))}; "
                    "put parameters of different dtypes into different groups."
                )
            flat_group = self._flatten(params)
            self._groups.append(flat_group)
            lo = self.rank * flat_group.chunk
            hi = min(lo + flat_group.chunk, flat_group.numel)
            local = flat_group.flat[lo:hi] if lo < hi else flat_group.flat[:0]
            shard = nn.Parameter(
                DTensor.from_local(
                    local, mesh, [Shard(0)], run_check=False, shape=torch.Size((flat_group.numel,)), stride=(1,)
                )
            )
            grad_local = flat_group.grad[lo:hi] if lo < hi else flat_group.grad[:0]
            shard.grad = DTensor.from_local(
                grad_local, mesh, [Shard(0)], run_check=False, shape=torch.Size((flat_group.numel,)), stride=(1,)
            )
            flat_group.shard = shard
            inner_groups.append({**hyper, "params": [shard]})
        accepted = inspect.signature(type(optimizer).__init__).parameters
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        try:
            self.inner = type(optimizer)(inner_groups, **kwargs)
        except TypeError as err:
            raise TypeError(
                f"`ZeroStrategy(stage=1)` could not rebuild {type(optimizer).__name__} from its defaults: {err}"
            ) from err
        super().__init__([torch.zeros(0)], dict(optimizer.defaults))
        # Share the inner optimizer's groups and state so schedulers and checkpoints act on the shards.
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._queued = False
        for g in self._groups:
            for p in g.params:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        # Reduce once, when the whole backward pass has finished (as DDP finalizes its buckets), so that
        # clipping and `on_before_optimizer_step` already see the averaged partitions.
        if self.require_sync and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._queued = False
        self.reduce_gradients()

    def _flatten(self, params: list[nn.Parameter]) -> _FlatGroup:
        numel = sum(p.numel() for p in params)
        chunk = math.ceil(numel / self.world)
        first = params[0]
        flat = torch.zeros(chunk * self.world, dtype=first.dtype, device=first.device)
        grad = torch.zeros_like(flat)
        offset = 0
        for p in params:
            n = p.numel()
            flat[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = flat[offset : offset + n].view_as(p)
            p.grad = grad[offset : offset + n].view_as(p)
            offset += n
        # Start from rank 0's parameters everywhere, as DDP does.
        dist.broadcast(flat, src=dist.get_global_rank(self.group, 0), group=self.group)
        return _FlatGroup(params, flat, grad, numel, chunk, None)  # type: ignore[arg-type]

    def _restore_grad_views(self) -> None:
        for g in self._groups:
            offset = 0
            for p in g.params:
                n = p.numel()
                view = g.grad[offset : offset + n].view_as(p)
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
                offset += n

    def reduce_gradients(self) -> None:
        """Average gradients into each rank's partition (in place); zero the partitions it does not own."""
        for g in self._groups:
            mine = g.grad[self.rank * g.chunk : (self.rank + 1) * g.chunk]
            dist.reduce_scatter_tensor(mine, g.grad, op=dist.ReduceOp.SUM, group=self.group)
            mine.div_(self.world)
            g.grad[: self.rank * g.chunk].zero_()
            g.grad[(self.rank + 1) * g.chunk :].zero_()
            self.comm_bytes += (self.world - 1) * mine.numel() * mine.element_size()

    def gather_parameters(self) -> None:
        for g in self._groups:
            mine = g.flat[self.rank * g.chunk : (self.rank + 1) * g.chunk]
            dist.all_gather_into_tensor(g.flat, mine, group=self.group)
            self.comm_bytes += (self.world - 1) * mine.numel() * mine.element_size()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.inner.step()
        self.gather_parameters()
        self._opt_called = True  # an LR scheduler re-bound to this wrapper checks it
        return loss

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the optimizer states without changing parameters (so a checkpoint can load into them)."""
        if self.inner.state:
            return
        lrs = [group["lr"] for group in self.inner.param_groups]
        for group in self.inner.param_groups:
            group["lr"] = 0.0
        for g in self._groups:
            g.grad.zero_()
        self.inner.step()
        for group, lr in zip(self.inner.param_groups, lrs, strict=True):
            group["lr"] = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        # Gradients are views into the flat buffers: zero them, never drop them.
        for g in self._groups:
            g.grad.zero_()
        self._restore_grad_views()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes held by this rank: full parameters and gradients, its partition of the optimizer state."""
        from lightning_bigtrain.functional.memory import tensor_bytes

        params = sum(g.numel * g.flat.element_size() for g in self._groups)
        states = (v for s in self.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        opt = sum(tensor_bytes(t) for t in states)
        return {"params": params, "grads": params, "optimizer": opt, "total": 2 * params + opt}
