"""Chunked linear + cross-entropy: the same loss and gradients as the plain head, without the full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_bigtrain.functional.fused_loss import chunked_linear_cross_entropy


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_matches_plain_cross_entropy_values_and_gradients(bias, chunk_size):
    torch.manual_seed(0)
    hidden = torch.randn(4, 25, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True) if bias else None
    targets = torch.randint(0, 50, (4, 25))
    targets[0, :5] = -100  # ignored tokens
    plain = F.cross_entropy((hidden @ weight.t() + (b if bias else 0)).reshape(-1, 50), targets.reshape(-1))
    ours = chunked_linear_cross_entropy(hidden, weight, targets, b, chunk_size=chunk_size)
    torch.testing.assert_close(ours, plain, rtol=1e-12, atol=1e-12)
    inputs = [hidden, weight] + ([b] if bias else [])
    expected = torch.autograd.grad(plain * 3.0, inputs)
    got = torch.autograd.grad(ours * 3.0, inputs)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_float32_within_rounding_and_all_ignored_is_zero():
    torch.manual_seed(0)
    hidden = torch.randn(300, 32, requires_grad=True)
    weight = torch.randn(1000, 32, requires_grad=True)
    targets = torch.randint(0, 1000, (300,))
    plain = F.cross_entropy(hidden @ weight.t(), targets)
    ours = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=64)
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-5)
    none = chunked_linear_cross_entropy(hidden, weight, torch.full((300,), -100), chunk_size=64)
    assert none.item() == 0.0


def test_bad_shapes_name_the_argument():
    with pytest.raises(ValueError, match=r"hidden size 8 does not match the weight's \(10, 4\)"):
        chunked_linear_cross_entropy(torch.randn(3, 8), torch.randn(10, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"targets of shape \(2,\) do not match the tokens \(3,\)"):
        chunked_linear_cross_entropy(torch.randn(3, 4), torch.randn(10, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"chunk_size=0"):
        chunked_linear_cross_entropy(
            torch.randn(3, 4), torch.randn(10, 4), torch.zeros(3, dtype=torch.long), chunk_size=0
        )
