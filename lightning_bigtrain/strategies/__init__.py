"""Lightning strategies of lightning_bigtrain; importing this registers their names with Lightning.

One class per engine: :class:`ZeroStrategy` (torch: flat shards, FSDP2) and :class:`DeepSpeedZeroStrategy`
(DeepSpeed's ZeRO); :func:`zero_strategy` picks either. Their options live in
:mod:`lightning_bigtrain.strategies.options`, which both engines import.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_bigtrain.strategies.auto import register_auto, zero_strategy
from lightning_bigtrain.strategies.compressed_ddp import CompressedDDPStrategy
from lightning_bigtrain.strategies.deepspeed_zero import DeepSpeedZeroStrategy
from lightning_bigtrain.strategies.options import DeepSpeedOptions, PipelineOptions, ZeroOptions
from lightning_bigtrain.strategies.zero import ZeroStrategy

__all__ = [
    "CompressedDDPStrategy",
    "DeepSpeedOptions",
    "DeepSpeedZeroStrategy",
    "PipelineOptions",
    "ZeroOptions",
    "ZeroStrategy",
    "register_all",
    "zero_strategy",
]


def register_all() -> None:
    """Register every strategy's names with Lightning's registry (idempotent)."""
    for cls in (ZeroStrategy, CompressedDDPStrategy, DeepSpeedZeroStrategy):
        cls.register_strategies(StrategyRegistry)
    register_auto(StrategyRegistry)


register_all()
