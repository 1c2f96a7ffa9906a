"""CompensatedStep: the stateful bf16 optimizer-step engine (a reused fp32 chunk workspace, Kahan buffers in
the optimizer state, per-step stochastic-rounding generators). The arithmetic and the method are described in
:mod:`lightning_bigtrain.functional.bf16`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, get_args

import torch

from lightning_bigtrain.functional.bf16 import (
    COMPENSATION_KEY,
    Compensation,
    _local,
    check_optimizer,
    stochastic_round_,
)
from lightning_bigtrain.functional.rng import fold_seed

__all__ = ["CompensatedStep"]


class _Workspace:
    """Reusable flat fp32 buffers, one per role (weights, gradients, each state), grown on demand."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, role: str, numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        key = (role, device, dtype)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer


class CompensatedStep:
    """Replaces ``optimizer.step`` with a compensated bf16 step (see the module docstring).

    Args:
        optimizer: A torch optimizer over bf16 parameters (plain tensors or DTensor shards).
        compensation: ``"kahan"``, ``"stochastic"`` or ``"none"`` (step in fp32, round to nearest).
        seed: Seed of the stochastic rounding; the draws of step ``k`` depend only on ``(seed, k)``, so
            replicas round identically and a resumed run rounds as the uninterrupted one did.
        chunk_numel: Most parameter elements stepped together in fp32 (a larger parameter is a chunk of
            its own).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        compensation: Compensation,
        *,
        seed: int = 0,
        chunk_numel: int = 1 << 22,
    ) -> None:
        if compensation not in get_args(Compensation):
            raise ValueError(f"`compensation={compensation!r}`: choose one of {', '.join(get_args(Compensation))}.")
        check_optimizer(optimizer)
        self.optimizer = optimizer
        self.compensation = compensation
        self.seed = seed
        self.steps = 0
        self.chunk_numel = chunk_numel
        self._workspace = _Workspace()
        self._step: Callable[..., Any] = optimizer.step
        optimizer.step = self.step  # type: ignore[method-assign]

    def detach(self) -> None:
        """Give the optimizer its own step back."""
        self.optimizer.step = self._step  # type: ignore[method-assign]

    def _chunks(self) -> Iterator[list[torch.Tensor]]:
        chunk: list[torch.Tensor] = []
        size = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                numel = _local(p).numel()
                if chunk and size + numel > self.chunk_numel:
                    yield chunk
                    chunk, size = [], 0
                chunk.append(p)
                size += numel
        if chunk:
            yield chunk

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        generators: dict[torch.device, torch.Generator] = {}
        for chunk in self._chunks():
            self._step_chunk(chunk, generators)
        self.steps += 1
        return loss

    def _generator(self, generators: dict[torch.device, torch.Generator], device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(fold_seed(self.seed, self.steps))
        return generators[device]

    def _step_chunk(self, chunk: list[torch.Tensor], generators: dict[torch.device, torch.Generator]) -> None:
        opt = self.optimizer
        total = sum(_local(p).numel() for p in chunk)
        device = _local(chunk[0]).device
        ws = self._workspace
        offsets: dict[int, int] = {}  # by id(parameter): where its elements start in the workspaces
        offset = 0
        for p in chunk:
            offsets[id(p)] = offset
            offset += _local(p).numel()

        def fp32_copy(role: str, source: torch.Tensor, like: torch.Tensor, at: int) -> torch.Tensor:
            """``source`` (bf16, shaped as ``like``) copied into the role's workspace, wrapped as ``like`` is."""
            local_src = _local(source)
            view = ws.get(role, total, device)[at : at + local_src.numel()].view(local_src.shape)
            view.copy_(local_src)
            return _wrap_like(view, like)

        swapped: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = []  # (param, fp32 copy, bf16 state)
        saved_groups = [group["params"] for group in opt.param_groups]
        for group in opt.param_groups:
            working = []
            for p in group["params"]:
                if id(p) not in offsets:
                    continue
                at = offsets[id(p)]
                state = opt.state.pop(p, {})
                w = fp32_copy("w", p, p, at)
                comp = state.get(COMPENSATION_KEY)
                if self.compensation == "kahan" and comp is not None:
                    # Same-dtype arithmetic only: mixed bf16/fp32 element-wise ops take a slow path on CPU.
                    w.add_(fp32_copy("comp", comp, p, at))
                assert p.grad is not None
                w.grad = fp32_copy("g", p.grad, p, at)
                opt.state[w] = {
                    k: (fp32_copy(f"state.{k}", v, v, at) if _is_moment(k, v) else v)
                    for k, v in state.items()
                    if k != COMPENSATION_KEY
                }
                swapped.append((p, w, state))
                working.append(w)
            group["params"] = working
        try:
            self._step()
        finally:
            for group, params in zip(opt.param_groups, saved_groups, strict=True):
                group["params"] = params
            for p, w, old_state in swapped:
                self._write_back(p, w, old_state, opt.state.pop(w, {}), generators, offsets[id(p)], total)

    def _write_back(
        self,
        p: torch.Tensor,
        w: torch.Tensor,
        old_state: dict[str, Any],
        new_state: dict[str, Any],
        generators: dict[torch.device, torch.Generator],
        at: int,
        total: int,
    ) -> None:
        state: dict[str, Any] = {}
        for key, value in new_state.items():
            if _is_moment(key, value):
                target = old_state.get(key)
                if target is None or target.dtype != p.dtype:  # created by this step (or restored in fp32)
                    target = torch.empty_like(value, dtype=p.dtype)
                target.copy_(value)  # round to nearest
                value = target
            state[key] = value
        w_local, p_local = _local(w), _local(p)
        if self.compensation == "stochastic":
            noise = self._workspace.get("noise", total, w_local.device, torch.int32)
            stochastic_round_(p_local, w_local, self._generator(generators, w_local.device), noise=noise)
        else:
            p_local.copy_(w_local)
        if self.compensation == "kahan":
            comp = old_state.get(COMPENSATION_KEY)
            if comp is None:
                comp = torch.zeros_like(p)
            # What rounding dropped, computed in the (now free) gradient workspace: w - p, exact in fp32.
            scratch = self._workspace.get("g", total, w_local.device)[at : at + w_local.numel()].view(w_local.shape)
            scratch.copy_(p_local)
            torch.sub(w_local, scratch, out=scratch)
            _local(comp).copy_(scratch)
            state[COMPENSATION_KEY] = comp
        self.optimizer.state[p] = state


def _wrap_like(local: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``local`` as a DTensor laid out as ``like`` when ``like`` is one, else ``local``."""
    if not hasattr(like, "to_local"):
        return local
    from torch.distributed.tensor import DTensor

    assert isinstance(like, DTensor)
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())  # fmt: skip


def _is_moment(key: str, value: Any) -> bool:
    """Per-element optimizer states (moments) go back to bf16; step counters and scalars stay as they are."""
    return key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0
