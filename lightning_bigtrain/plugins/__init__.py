"""Lightning plugins of lightning_bigtrain, passed as ``Trainer(plugins=[...])``."""

from lightning_bigtrain.plugins.layer_sync import GlooSyncBatchNorm
from lightning_bigtrain.plugins.precision import BF16Precision

__all__ = ["BF16Precision", "GlooSyncBatchNorm"]
