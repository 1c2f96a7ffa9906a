"""functional.distillation against hand formulas; the top-k approximation's error; the logit cache."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_bigtrain.engines.logit_cache import LogitCache
from lightning_bigtrain.functional.distillation import (
    agreement,
    feature_loss,
    kd_loss,
    make_projection,
    module_fingerprint,
    sample_keys,
    topk_kd_loss,
    topk_logits,
)


def _hand_kd(s: torch.Tensor, t: torch.Tensor, T: float) -> float:
    total, rows = 0.0, 0
    for srow, trow in zip(s.reshape(-1, s.shape[-1]).tolist(), t.reshape(-1, t.shape[-1]).tolist(), strict=True):
        zs = sum(math.exp(v / T) for v in srow)
        zt = sum(math.exp(v / T) for v in trow)
        for a, b in zip(srow, trow, strict=True):
            pt = math.exp(b / T) / zt
            total += pt * (math.log(pt) - math.log(math.exp(a / T) / zs))
        rows += 1
    return T * T * total / rows


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 11)])
@pytest.mark.parametrize("T", [1.0, 4.0])
def test_kd_loss_is_hintons_formula(shape, T):
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    assert kd_loss(s, t, T).item() == pytest.approx(_hand_kd(s, t, T), rel=1e-6)
    assert kd_loss(t, t, T).item() == pytest.approx(0.0, abs=1e-6)


def test_kd_loss_gradient_is_the_softened_probability_gap():
    # d/ds [T^2 KL] = T (p_s - p_t) per row, divided by the number of rows (batchmean).
    s = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    t = torch.randn(4, 6, dtype=torch.float64)
    kd_loss(s, t, 3.0).backward()
    expected = 3.0 * (torch.softmax(s.detach() / 3, -1) - torch.softmax(t / 3, -1)) / 4
    torch.testing.assert_close(s.grad, expected)


def _grad(loss_fn, s: torch.Tensor) -> torch.Tensor:
    s = s.clone().requires_grad_()
    loss_fn(s).backward()
    return s.grad


def test_topk_kd_is_exact_with_every_class_and_its_gradient_error_shrinks_with_k():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(64, 32, generator=g, dtype=torch.float64)
    t = 3 * torch.randn(64, 32, generator=g, dtype=torch.float64)  # a confident teacher
    full = _grad(lambda x: kd_loss(x, t, 2.0), s)
    errors, renormalized = {}, {}
    for k in (1, 4, 8, 16, 32):
        v, i, z = topk_logits(t, k, 2.0)
        errors[k] = (_grad(lambda x, v=v, i=i, z=z: topk_kd_loss(x, v, i, 2.0, z), s) - full).norm() / full.norm()
        renormalized[k] = (_grad(lambda x, v=v, i=i: topk_kd_loss(x, v, i, 2.0), s) - full).norm() / full.norm()
    assert errors[32] < 1e-6 and renormalized[32] < 1e-6
    values, indices, log_z = topk_logits(t, 32, 2.0)
    assert topk_kd_loss(s, values, indices, 2.0, log_z).item() == pytest.approx(kd_loss(s, t, 2.0).item(), rel=1e-6)
    assert errors[16] < errors[8] < errors[4] < errors[1]
    # The merged tail class keeps the gradient closer than renormalizing over the top-k (documented figures).
    assert errors[16] < 0.06 and errors[8] < 0.16
    for k in (1, 4, 8, 16):
        assert errors[k] < renormalized[k] / 2


def test_bad_temperature_and_mismatched_shapes():
    with pytest.raises(ValueError, match=r"`temperature=0` must be > 0"):
        kd_loss(torch.zeros(2, 3), torch.zeros(2, 3), 0)
    with pytest.raises(ValueError, match=r"the teacher's logits have shape \(2, 5\), the student's \(2, 3\)"):
        kd_loss(torch.zeros(2, 3), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="must share the student's leading shape"):
        topk_kd_loss(torch.zeros(2, 3), torch.zeros(4, 2), torch.zeros(4, 2, dtype=torch.long))


def test_agreement_and_feature_hints():
    s = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]])
    t = torch.tensor([[0.0, 5.0], [0.0, 1.0], [1.0, 0.0]])
    assert agreement(s, t).item() == pytest.approx(1 / 3)
    assert agreement(s, t.argmax(-1)).item() == pytest.approx(1 / 3)
    assert isinstance(make_projection(8, 8, conv=True), nn.Identity)
    conv = make_projection(8, 16, conv=True)
    assert isinstance(conv, nn.Conv2d) and conv.kernel_size == (1, 1)
    x, y = torch.randn(2, 8, 5, 5), torch.randn(2, 16, 5, 5)
    torch.testing.assert_close(feature_loss(x, y, conv), ((conv(x) - y) ** 2).mean())
    with pytest.raises(ValueError, match=r"projected student feature has shape \(2, 16, 5, 5\), the teacher's"):
        feature_loss(x, torch.randn(2, 16, 4, 4), conv)


def test_sample_keys_address_content():
    x = torch.randn(3, 4)
    keys = sample_keys(x)
    assert len(set(keys)) == 3 and all(len(k) == 16 for k in keys)
    assert sample_keys(x.clone()[[2, 0]]) == [keys[2], keys[0]]
    assert sample_keys(x + 1e-6) != keys  # any change of the input is a different sample


def test_logit_cache_round_trip_and_refuses_another_teacher(tmp_path):
    a, b = nn.Linear(3, 4), nn.Linear(3, 4)
    fa = module_fingerprint(a)
    assert fa == module_fingerprint(a) and fa != module_fingerprint(b)
    cache = LogitCache(fa, k=2, temperature=2.0)
    x = torch.randn(5, 3)
    values, indices, log_z = topk_logits(a(x), 2, 2.0)
    keys = sample_keys(x)
    assert cache.get(keys) is None
    cache.put(keys, values, indices, log_z)
    url = str(tmp_path / "sub" / "kd.pt")
    cache.save(url)
    loaded = LogitCache.load(url, fa, 2, 2.0)
    assert loaded is not None and len(loaded) == 5 and not loaded.new
    got = loaded.get(keys[::-1])
    assert got is not None
    torch.testing.assert_close(got[0].float(), values.flip(0).half().float())
    assert torch.equal(got[1], indices.flip(0).int())
    torch.testing.assert_close(got[2], log_z.flip(0))
    assert loaded.get([*keys[:2], b"x" * 16]) is None
    assert LogitCache.load(str(tmp_path / "none.pt"), fa, 2, 2.0) is None
    for teacher, k, T in ((module_fingerprint(b), 2, 2.0), (fa, 3, 2.0), (fa, 2, 4.0)):
        with pytest.raises(ValueError, match=r"was written for another teacher, top-k or temperature.*rebuild_cache"):
            LogitCache.load(url, teacher, k, T)
