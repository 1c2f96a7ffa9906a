"""Unit tests of the step-derived seeds."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_bigtrain.functional.rng import fold_seed, seed_all_


def test_fold_seed_is_deterministic_and_spreads_neighbours():
    seeds = [fold_seed(0, i) for i in range(1000)]
    assert seeds == [fold_seed(0, i) for i in range(1000)]
    assert len(set(seeds)) == 1000
    assert fold_seed(1, 0) != fold_seed(0, 0) and fold_seed(0, 1) != fold_seed(1, 0)
    assert all(0 <= s < 2**63 for s in seeds)
    # Neighbouring counters differ in about half of their bits (an avalanche, not an increment).
    flips = [bin(seeds[i] ^ seeds[i + 1]).count("1") for i in range(999)]
    assert 25 < sum(flips) / len(flips) < 38


def test_fold_seed_rejects_negative_counter():
    with pytest.raises(ValueError, match=r"fold_seed\(counter=-1\)"):
        fold_seed(0, -1)


def test_seed_all_reproduces_torch_and_python_draws():
    seed_all_(fold_seed(7, 3))
    first = (torch.rand(4), random.random())
    torch.rand(10)  # draws in between are forgotten by the next seeding
    seed_all_(fold_seed(7, 3))
    second = (torch.rand(4), random.random())
    assert torch.equal(first[0], second[0]) and first[1] == second[1]
