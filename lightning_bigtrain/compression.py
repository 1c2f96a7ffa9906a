"""Gradient compressors for ``CompressedDDPStrategy(compression=...)`` and ``ZeroStrategy(compression=...)``.

>>> from lightning_bigtrain.compression import PowerSGD, TopK
>>> strategy = CompressedDDPStrategy(compression=PowerSGD(rank=4))  # doctest: +SKIP

See :mod:`lightning_bigtrain.functional.compression` for the methods, their papers and byte formulas.
"""

from lightning_bigtrain.functional.compression import (
    COMPRESSORS,
    Cast,
    Compressor,
    GradientCompression,
    OneBit,
    PowerSGD,
    Quantize,
    TopK,
)
from lightning_bigtrain.strategies._compression import COMPRESSION_NAMES

__all__ = [
    "COMPRESSION_NAMES",
    "COMPRESSORS",
    "Cast",
    "Compressor",
    "GradientCompression",
    "OneBit",
    "PowerSGD",
    "Quantize",
    "TopK",
]
