"""Lightning strategies of lightning_bigtrain; importing this registers their names with Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_bigtrain.strategies.compressed_ddp import CompressedDDPStrategy
from lightning_bigtrain.strategies.deepspeed_zero import DeepSpeedOptions, DeepSpeedZeroStrategy
from lightning_bigtrain.strategies.zero import ZeroOptions, ZeroStrategy

__all__ = [
    "CompressedDDPStrategy",
    "DeepSpeedOptions",
    "DeepSpeedZeroStrategy",
    "ZeroOptions",
    "ZeroStrategy",
    "register_all",
]


def register_all() -> None:
    """Register every strategy's names with Lightning's registry (idempotent)."""
    for cls in (ZeroStrategy, CompressedDDPStrategy, DeepSpeedZeroStrategy):
        cls.register_strategies(StrategyRegistry)


register_all()
