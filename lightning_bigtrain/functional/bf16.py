"""Compensated bf16 arithmetic (stateless): stochastic rounding and the optimizer check; the step engine that
uses them is :class:`~lightning_bigtrain.engines.compensated.CompensatedStep`. Parameters, gradients and
optimizer states in bf16, updates that are not lost to rounding.

A bf16 number keeps 8 significant bits, so an update smaller than half a unit in the last place of its
weight rounds away (Zamirai et al., "Revisiting BFloat16 Training", 2020). Two remedies, for any
element-wise torch optimizer:

* **Kahan compensation**: a bf16 buffer ``c`` per parameter holds what rounding dropped. The step runs in
  fp32 on ``w = p + c``; then ``p = round(w)`` and ``c = round(w - p)``, so ``p + c`` carries about 16
  significant bits (Kahan, "Further remarks on reducing truncation errors", CACM 1965). 2 bytes per
  parameter, kept in the optimizer's state (and so saved and sharded with it).
* **Stochastic rounding**: ``p = round_up(w)`` with probability proportional to the distance to the
  lower neighbour, else ``round_down(w)``, which is unbiased, ``E[p] = w`` (Gupta et al., "Deep learning
  with limited numerical precision", ICML 2015). No extra memory.

The optimizer itself is unchanged: its step runs over fp32 copies of a chunk of parameters at a time (the
parameter objects in its groups and state are swapped for the copies and back), so the extra fp32 memory
is a workspace bounded by ``chunk_numel``, not by the model; it is reused from step to step (fresh
allocations of that size cost more than the casts here: the pages are faulted in anew each time).
Optimizer states are written back to bf16 with round-to-nearest in every mode. Optimizers whose update
couples parameters through a closure (LBFGS) are refused.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["COMPENSATION_KEY", "Compensation", "check_optimizer", "stochastic_round_"]

Compensation = Literal["kahan", "stochastic", "none"]
COMPENSATION_KEY = "bf16_compensation"
_REFUSED = ("LBFGS",)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local tensor of a DTensor (a view sharing its storage), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def stochastic_round_(
    out: torch.Tensor,
    value: torch.Tensor,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> None:
    """Write ``value`` (fp32) into ``out`` (bf16), rounded stochastically: up or down to a neighbouring bf16
    number with probabilities that make the result unbiased. ``value`` is overwritten.

    A bf16 number is the upper 16 bits of an fp32 one. Adding a uniform random integer in [0, 2^16) to the
    fp32 bit pattern and truncating the lower 16 bits rounds the magnitude up with probability equal to
    the dropped fraction (the sign bit is untouched, so this is symmetric for negative numbers; infinities
    and the canonical NaN keep their upper bits).

    Args:
        out: bf16 destination, same shape as ``value``.
        value: fp32 source (contiguous); used as scratch.
        generator: Source of the random bits.
        noise: Optional int32 scratch of at least ``numel`` elements (avoids an allocation).
    """
    if out.dtype != torch.bfloat16 or value.dtype != torch.float32:
        raise TypeError(f"stochastic_round_: expected bf16 out and fp32 value, got {out.dtype} and {value.dtype}.")
    n = value.numel()
    if noise is None or noise.numel() < n:
        noise = torch.empty(n, dtype=torch.int32, device=value.device)
    # random_() fills [0, 2^31); its low 16 bits are uniform on [0, 2^16). (Cheaper here than a bounded draw,
    # and int32 + int32 stays on the fast path.)
    random16 = noise[:n].view(value.shape).random_(generator=generator).bitwise_and_(0xFFFF)
    bits = value.view(torch.int32)
    bits.add_(random16).bitwise_and_(-65536)  # -65536 is 0xFFFF0000 as int32
    out.copy_(bits.view(torch.float32))


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise a clear TypeError for optimizers a compensated bf16 step cannot drive."""
    name = type(optimizer).__name__
    if name in _REFUSED:
        raise TypeError(
            f"BF16Precision cannot drive {name}: its state (curvature history) couples all parameters and is "
            "not a per-parameter tensor that can be kept in bf16. Use an element-wise optimizer (SGD, Adam, "
            "AdamW, ...) or train LBFGS in fp32."
        )
