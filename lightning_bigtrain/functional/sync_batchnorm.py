"""Batch normalization over the whole batch of every rank, on CPU ranks (gloo).

torch's ``nn.SyncBatchNorm`` runs only on GPUs (its forward refuses CPU tensors, and DDP refuses it in a CPU
module), so ``Trainer(sync_batchnorm=True)`` could not run on CPU ranks. :class:`CPUSyncBatchNorm` computes the
statistics of the batch across the process group with two autograd-aware all-reduces (the per-channel sum and count,
then the sum of squared deviations from the global mean: the two-pass variance, as one process computes it on the
whole batch), so forward, backward and the running statistics are those of one process on the concatenated batch
(Ioffe & Szegedy, 2015: the running variance is the unbiased one).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce

__all__ = ["CPUSyncBatchNorm", "convert_cpu_sync_batchnorm", "revert_cpu_sync_batchnorm"]


class CPUSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """``nn.SyncBatchNorm`` for CPU tensors: in training, normalizes with the mean and variance of the batch over all
    ranks of ``process_group`` (the world by default), for inputs of any rank ``>= 2`` (channels in dimension 1). In
    evaluation, or on one rank, it is plain batch normalization. Made by :func:`convert_cpu_sync_batchnorm`."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group
        self.original_class: type[nn.Module] | None = None  # the BatchNorm class it replaced (revert restores it)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"CPUSyncBatchNorm expects an input of at least 2 dimensions, got {input.dim()}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        group = self.process_group or (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None)
        if not self.training or group is None or dist.get_world_size(group) == 1:
            return super().forward(input)
        if input.device.type != "cpu":
            raise ValueError(
                f"CPUSyncBatchNorm got a {input.device.type} tensor: it synchronizes CPU ranks. On GPUs use torch's "
                "`nn.SyncBatchNorm` (`Trainer(sync_batchnorm=True)`)."
            )
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        x = input.float()
        dims = [0, *range(2, x.dim())]
        count = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float32)
        totals = all_reduce(torch.cat([x.sum(dims), count]), group=group)
        n = totals[-1]
        mean = totals[:-1] / n
        shape = [1, -1] + [1] * (x.dim() - 2)
        centered = x - mean.view(shape)
        var = all_reduce((centered * centered).sum(dims), group=group) / n
        out = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
            with torch.no_grad():
                unbiased = var * (n / (n - 1)) if float(n) > 1 else var
                self.running_mean.mul_(1 - factor).add_(mean.detach().to(self.running_mean.dtype), alpha=factor)
                self.running_var.mul_(1 - factor).add_(unbiased.detach().to(self.running_var.dtype), alpha=factor)
        return out.to(input.dtype)


def convert_cpu_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Every batch normalization layer of ``module`` (BatchNorm1d/2d/3d, and torch's ``SyncBatchNorm``) replaced by a
    :class:`CPUSyncBatchNorm` holding the same parameters and buffers; returns the module (a new one if ``module``
    itself is one). Instance norms, whose statistics are per sample, are left alone."""
    result = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, CPUSyncBatchNorm):
        result = CPUSyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group)  # fmt: skip
        result.original_class = type(module)
        _move_state(module, result)
    for name, child in module.named_children():
        result.add_module(name, convert_cpu_sync_batchnorm(child, process_group))
    return result


def revert_cpu_sync_batchnorm(module: nn.Module) -> nn.Module:
    """The inverse of :func:`convert_cpu_sync_batchnorm`: each :class:`CPUSyncBatchNorm` it made back to the class it
    replaced, with its parameters and buffers (one built directly stays)."""
    result = module
    if isinstance(module, CPUSyncBatchNorm) and module.original_class is not None:
        cls = module.original_class
        if issubclass(cls, nn.SyncBatchNorm):
            result = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats,
                         module.process_group)  # fmt: skip
        else:
            result = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        _move_state(module, result)
    for name, child in module.named_children():
        result.add_module(name, revert_cpu_sync_batchnorm(child))
    return result


def _move_state(source: nn.Module, target: nn.Module) -> None:
    """``source``'s parameters and buffers (the same tensors), and its training mode, into ``target``."""
    for name, param in source.named_parameters(recurse=False):
        setattr(target, name, param)
    for name, buffer in source.named_buffers(recurse=False):
        setattr(target, name, buffer)
    target.train(source.training)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig
