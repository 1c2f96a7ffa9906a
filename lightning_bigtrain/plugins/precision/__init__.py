"""Precision plugins of lightning_bigtrain (one Precision subclass per file)."""

from lightning_bigtrain.plugins.precision.bf16 import BF16Precision

__all__ = ["BF16Precision"]
