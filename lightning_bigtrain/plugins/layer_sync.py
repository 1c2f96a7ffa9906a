"""``GlooSyncBatchNorm``: ``Trainer(sync_batchnorm=True)`` for CPU ranks, as a Lightning ``LayerSync`` plugin."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.layer_sync import LayerSync, TorchSyncBatchNorm
from torch.nn import Module
from typing_extensions import override

from lightning_bigtrain.functional.sync_batchnorm import convert_cpu_sync_batchnorm, revert_cpu_sync_batchnorm

__all__ = ["GlooSyncBatchNorm", "layer_sync_for"]


class GlooSyncBatchNorm(LayerSync):
    """Synchronized batch normalization on CPU ranks: each BatchNorm layer normalizes with the statistics of the whole
    batch across the ranks (:class:`~lightning_bigtrain.functional.sync_batchnorm.CPUSyncBatchNorm`), as torch's
    ``nn.SyncBatchNorm`` does on GPUs, where it alone runs.

    This package's strategies take ``Trainer(sync_batchnorm=True)`` on CPU ranks as this plugin. Lightning's own
    DDP refuses ``sync_batchnorm=True`` on CPU ("SyncBatchNorm layers only work with GPU modules"); give it this
    plugin instead: ``Trainer(strategy="ddp", accelerator="cpu", plugins=[GlooSyncBatchNorm()])``.

    Args:
        process_group: The ranks to synchronize over (None: all).
    """

    def __init__(self, process_group: Any = None) -> None:
        self.process_group = process_group

    @override
    def apply(self, model: Module) -> Module:
        return convert_cpu_sync_batchnorm(model, self.process_group)

    @override
    def revert(self, model: Module) -> Module:
        return revert_cpu_sync_batchnorm(model)


def layer_sync_for(layer_sync: LayerSync | None, device_type: str) -> LayerSync | None:
    """The layer sync a strategy applies on ``device_type``: ``Trainer(sync_batchnorm=True)`` (Lightning's
    ``TorchSyncBatchNorm``, torch's GPU-only ``nn.SyncBatchNorm``) becomes :class:`GlooSyncBatchNorm` on CPU ranks;
    anything else (a user's own ``LayerSync`` plugin, or none) stays."""
    if device_type == "cpu" and type(layer_sync) is TorchSyncBatchNorm:
        return GlooSyncBatchNorm()
    return layer_sync
