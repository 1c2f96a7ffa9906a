"""Strategies by short name, for tests that run one scenario under several: ``"ddp"`` (Lightning's),
``"zeroN"`` (ZeroStrategy at stage N, blocks of the tiny test models as units) and ``"dsN"`` (DeepSpeed's stage N)."""

from __future__ import annotations

from typing import Any

from lightning_bigtrain.strategies import DeepSpeedZeroStrategy, ZeroStrategy

__all__ = ["strategy"]


def strategy(name: str) -> Any:
    if name == "ddp":
        return "ddp"
    if name.startswith("ds"):
        return DeepSpeedZeroStrategy(int(name[2]))
    if name.startswith("zero"):
        return ZeroStrategy(stage=int(name[4]), min_wrap_params=1000)
    raise ValueError(f"unknown strategy name {name!r}")
