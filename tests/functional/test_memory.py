"""Byte accounting of model states."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from lightning_bigtrain.functional import model_state_bytes, peak_memory_bytes


def test_fp32_adamw_is_16_bytes_per_parameter_plus_step_counters():
    model = nn.Sequential(nn.Linear(10, 20), nn.Linear(20, 5))
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    before = model_state_bytes(model, opt)
    assert before == {"params": 4 * n, "grads": 0, "optimizer": 0, "total": 4 * n}
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    after = model_state_bytes(model, opt)
    # params 4 + grads 4 + exp_avg 4 + exp_avg_sq 4 bytes each; one scalar fp32 `step` per tensor.
    assert after["grads"] == 4 * n
    assert after["optimizer"] == 8 * n + 4 * 4
    assert after["total"] == 16 * n + 16


def test_shared_parameters_count_once():
    layer = nn.Linear(4, 4)
    assert model_state_bytes(nn.Sequential(layer, layer))["params"] == 4 * 20


def test_peak_memory_is_positive_and_monotonic():
    first = peak_memory_bytes()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB touched
    assert peak_memory_bytes() >= first > 0
    assert peak_memory_bytes() >= 64 * 2**20
    del big


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_mmap_threshold_is_set_through_glibc():
    from lightning_bigtrain.functional.memory import set_mmap_threshold

    assert set_mmap_threshold(128 * 1024) is True
