"""The one rule for when this package's step metrics reach the loggers: Lightning's ``log_every_n_steps``."""

from __future__ import annotations

from typing import Any

__all__ = ["is_logging_step", "log_interval"]


def log_interval(trainer: Any) -> int:
    """Optimizer steps between logged steps (``Trainer(log_every_n_steps=...)``); 0 when nothing is logged."""
    return max(int(getattr(trainer, "log_every_n_steps", 0) or 0), 0)


def is_logging_step(trainer: Any) -> bool:
    """Whether the optimizer step in progress is one whose metrics Lightning writes to the loggers: every
    ``log_every_n_steps``-th, counted from 1 as Lightning counts them (``global_step`` moves after the step)."""
    every = log_interval(trainer)
    return every > 0 and (trainer.global_step + 1) % every == 0
