"""The pruning schedule shared by MagnitudePruning and StructuredPruning."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["PruningSchedule"]


@dataclass(frozen=True, kw_only=True)
class PruningSchedule:
    """When :class:`MagnitudePruning` prunes, in optimizer steps (``trainer.global_step``).

    An ``int`` is a step; a ``float`` in ``[0, 1]`` is a fraction of ``trainer.estimated_stepping_batches``.
    Between ``start`` and ``end`` the sparsity follows Zhu & Gupta's cubic ramp (2017), updated every
    ``frequency`` steps; from ``end`` on it is the final sparsity and training fine-tunes the survivors.

    Attributes:
        start: First pruning step.
        end: Step at which the final sparsity is reached. The default leaves the last quarter of the run to
            recover at full sparsity.
        frequency: Steps between pruning events; default: 10 events over the ramp.
        initial_sparsity: Sparsity of the first event (``s_i`` in the paper).
    """

    start: int | float = 0
    end: int | float = 0.75
    frequency: int | None = None
    initial_sparsity: float = 0.0

    def __post_init__(self) -> None:
        for name in ("start", "end"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"PruningSchedule({name}={value!r}): expected a step (int) or a fraction (float).")
            if isinstance(value, float) and not 0.0 <= value <= 1.0:
                raise ValueError(
                    f"PruningSchedule({name}={value}): a float is a fraction of the run's steps and must be in "
                    "[0, 1]; give an int for an absolute step."
                )
            if isinstance(value, int) and value < 0:
                raise ValueError(f"PruningSchedule({name}={value}): steps are >= 0.")
        if self.frequency is not None and self.frequency < 1:
            raise ValueError(f"PruningSchedule(frequency={self.frequency}): must be >= 1 step.")
        if not 0.0 <= self.initial_sparsity < 1.0:
            raise ValueError(f"PruningSchedule(initial_sparsity={self.initial_sparsity}): must be in [0, 1).")

    def resolve(self, total_steps: float) -> tuple[int, int, int]:
        """``(start, end, frequency)`` in steps for a run of ``total_steps`` optimizer steps."""

        def steps(value: int | float) -> int:
            if isinstance(value, float):
                if not math.isfinite(total_steps):
                    raise ValueError(
                        f"PruningSchedule: the fraction {value} needs a run of known length (set max_steps or "
                        "max_epochs), or give the schedule in steps (ints)."
                    )
                return round(value * total_steps)
            return value

        start, end = steps(self.start), steps(self.end)
        if end < start:
            raise ValueError(f"PruningSchedule: end (step {end}) comes before start (step {start}).")
        frequency = self.frequency or max(1, (end - start) // 10)
        return start, end, frequency
