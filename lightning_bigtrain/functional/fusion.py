"""Fusion helpers: the user's optimizer rebuilt with its fused kernel, repeated blocks found for regional compile."""

from __future__ import annotations

import inspect
from collections import Counter

import torch
from torch import nn

__all__ = ["fuse_optimizer", "repeated_blocks", "supports_fused"]


def supports_fused(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot be rebuilt with ``fused=True`` (None when it can)."""
    cls = type(optimizer)
    if "fused" not in inspect.signature(cls.__init__).parameters:
        return f"{cls.__qualname__} has no fused implementation"
    if optimizer.defaults.get("differentiable"):
        return "differentiable optimizers cannot be fused"
    for group in optimizer.param_groups:
        for p in group["params"]:
            if type(p) is not nn.Parameter and type(p) is not torch.Tensor:
                return f"parameters of type {type(p).__name__} (sharded tensors) are not supported by the fused kernel"
            if p.device.type not in ("cpu", "cuda") or not p.is_floating_point():
                return f"a {p.dtype} parameter on {p.device.type}"
    return None


def fuse_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same optimizer (class, param groups, hyper-parameters and state) on its fused kernel.

    torch's optimizers default to the for-loop implementation on CPU (``foreach`` is only chosen on CUDA);
    the fused kernel does the whole update in one pass per tensor. State is carried over exactly
    (``load_state_dict``), so this can happen mid-run and after a checkpoint restore.
    """
    reason = supports_fused(optimizer)
    if reason is not None:
        raise ValueError(f"fuse_optimizer({type(optimizer).__name__}): {reason}.")
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    defaults.update(fused=True, foreach=False) if "foreach" in accepted else defaults.update(fused=True)
    groups = [dict(group) for group in optimizer.param_groups]
    for group in groups:
        group.update(fused=True)
        if "foreach" in accepted:
            group["foreach"] = False
    fused = cls(groups, **defaults)
    fused.load_state_dict(optimizer.state_dict())
    for group in fused.param_groups:  # load_state_dict restored the saved groups' flags
        group["fused"] = True
        if "foreach" in group:
            group["foreach"] = False
    return fused


def repeated_blocks(module: nn.Module, min_count: int = 2) -> list[nn.Module]:
    """The outermost submodules whose class occurs at least ``min_count`` times (transformer blocks, ResNet
    stages' blocks): compiling each once and reusing the code for every instance cuts compile time."""
    counts = Counter(type(m) for m in module.modules() if m is not module and any(True for _ in m.parameters()))
    # (plain Sequential/ModuleList/ModuleDict are skipped below: their type says nothing about what they hold)
    chosen: list[nn.Module] = []
    for name, m in module.named_modules():
        if m is module or counts[type(m)] < min_count:
            continue
        if any(name.startswith(f"{c}.") for c in (n for n, mm in module.named_modules() if mm in chosen)):
            continue
        if len(list(m.children())) == 0:  # a single layer (Linear, LayerNorm): nothing to fuse across
            continue
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):  # never called: compiling its call compiles nothing
            continue
        if type(m) is nn.Sequential:  # a container, not a kind of block: unrelated Sequentials share the type
            continue
        chosen.append(m)
    return chosen
