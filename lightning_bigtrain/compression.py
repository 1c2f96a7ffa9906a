"""Gradient compressors for ``CompressedDDPStrategy(compression=...)`` and ``ZeroStrategy(compression=...)``.

>>> from lightning_bigtrain.compression import PowerSGD, TopK
>>> strategy = CompressedDDPStrategy(compression=PowerSGD(rank=4))  # doctest: +SKIP
>>> strategy = CompressedDDPStrategy(compression="auto")  # dense fp16 unless PowerSGD is timed faster  # doctest: +SKIP
>>> strategy = CompressedDDPStrategy(compression=OneBitAdam(warmup_steps=0.15))  # 1-bit Adam  # doctest: +SKIP

See :mod:`lightning_bigtrain.functional.compression` for the methods, their papers and byte formulas.
"""

from lightning_bigtrain.engines.auto_compression import AutoCompression
from lightning_bigtrain.engines.compression import GradientCompression
from lightning_bigtrain.engines.onebit_adam import CompressedMomentumAdam, OneBitAdam
from lightning_bigtrain.functional.compression import (
    COMPRESSION_NAMES,
    COMPRESSORS,
    Cast,
    Compressor,
    OneBit,
    PowerSGD,
    Quantize,
    TopK,
)

__all__ = [
    "COMPRESSION_NAMES",
    "COMPRESSORS",
    "AutoCompression",
    "Cast",
    "CompressedMomentumAdam",
    "Compressor",
    "GradientCompression",
    "OneBit",
    "OneBitAdam",
    "PowerSGD",
    "Quantize",
    "TopK",
]
