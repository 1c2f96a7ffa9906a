"""Step-derived random seeds: a resumed run draws the same random numbers as the uninterrupted one.

Saving and restoring the generators' states is not enough under Lightning: the trainer itself draws
from the global generator at points that differ between a fresh and a resumed run (a DataLoader
iterator takes a base seed when it is created; a resumed run creates it before training restarts and
runs its sanity check at another point). Instead the generators are re-seeded before every training
batch from a run seed and the batch's index over the run, so the draws inside each step depend only on
where training is, never on how it got there (the ``fold_in`` idea of counter-based generators;
Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011).
"""

from __future__ import annotations

import random

import torch

__all__ = ["fold_seed", "seed_all_"]

_MASK64 = (1 << 64) - 1


def fold_seed(seed: int, counter: int) -> int:
    """A 63-bit seed derived from ``seed`` and ``counter`` with SplitMix64's finaliser (Steele et al.,
    "Fast splittable pseudorandom number generators", OOPSLA 2014): neighbouring counters give
    unrelated seeds.

    Args:
        seed: The run's base seed (any integer).
        counter: Position in the run, e.g. the batch index over all epochs (>= 0).
    """
    if counter < 0:
        raise ValueError(f"`fold_seed(counter={counter})`: counter must be >= 0.")
    z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def seed_all_(seed: int) -> None:
    """Seed torch (CPU and every accelerator), Python's ``random`` and NumPy (when installed)."""
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        return
    np.random.seed(seed % 2**32)
