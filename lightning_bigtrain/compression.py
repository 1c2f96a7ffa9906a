"""Gradient compressors for ``CompressedDDPStrategy(compression=...)`` and ``ZeroStrategy(compression=...)``.

>>> from lightning_bigtrain.compression import PowerSGD, TopK
>>> strategy = CompressedDDPStrategy(compression=PowerSGD(rank=4))  # doctest: +SKIP

See :mod:`lightning_bigtrain.functional.compression` for the methods, their papers and byte formulas.
"""

from lightning_bigtrain.engines.compression import GradientCompression
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
    "Cast",
    "Compressor",
    "GradientCompression",
    "OneBit",
    "PowerSGD",
    "Quantize",
    "TopK",
]
