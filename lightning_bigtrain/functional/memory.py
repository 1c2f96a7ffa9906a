"""Byte accounting of model states (parameters, gradients, optimizer states) and process peak memory."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["model_state_bytes", "peak_memory_bytes", "tensor_bytes"]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds for ``t``: its local shard when ``t`` is a DTensor."""
    to_local = getattr(t, "to_local", None)
    local = to_local() if callable(to_local) else t
    return local.numel() * local.element_size()


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def model_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states held by this process.

    Returns:
        ``{"params": ..., "grads": ..., "optimizer": ..., "total": ...}``. Shared parameters count once;
        sharded (DTensor) parameters and states count their local shard only.
    """
    params = _unique(module.parameters())
    out = {
        "params": sum(tensor_bytes(p) for p in params),
        "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        states = (v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        out["optimizer"] = sum(tensor_bytes(t) for t in _unique(states))
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory of this process: CUDA allocator peak on a GPU, else peak resident set size (RSS)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes
