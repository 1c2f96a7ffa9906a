"""Byte accounting of model states (parameters, gradients, optimizer states) and process peak memory."""

from __future__ import annotations

import re
import resource
import sys
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["model_state_bytes", "parse_bytes", "peak_memory_bytes", "set_mmap_threshold", "tensor_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: str | int | float, name: str = "device_memory") -> int:
    """``"80GB"``, ``"80GiB"``, ``"512MiB"`` or a number of bytes -> bytes."""
    if isinstance(value, int | float):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ValueError(
            f"`{name}={value!r}`: not a size. Write a number with one of the units "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '80GB'."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements held by this process: its local shard when ``t`` is a DTensor."""
    local = _local(t)
    return local.numel() * local.element_size()


def _storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views into one flat buffer count it once)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = _local(t)
        if local.numel() == 0:
            continue
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states held by this process.

    Counted by distinct storage: shared parameters count once; parameters or gradients that are views
    into one flat buffer count that buffer once; DTensors count their local shard. The optimizer's own
    parameters are included (a sharded optimizer may step slices that are not module parameters, with
    gradients of their own).

    Returns:
        ``{"params": ..., "grads": ..., "optimizer": ..., "total": ...}``.
    """
    params = list(module.parameters())
    if optimizer is not None:
        params += [p for group in optimizer.param_groups for p in group["params"]]
    out = {
        "params": _storage_bytes(params),
        "grads": _storage_bytes(p.grad for p in params),
        "optimizer": 0,
    }
    if optimizer is not None:
        out["optimizer"] = _storage_bytes(
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        )
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def peak_memory_bytes(device: torch.device | None = None) -> int:
    """Peak memory of this process: CUDA allocator peak on a GPU, else peak resident set size (RSS)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve host allocations above ``nbytes`` by ``mmap`` (returned to the system when freed) and stop glibc from
    raising that threshold dynamically. Returns whether it was applied (glibc on Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(nbytes)))
