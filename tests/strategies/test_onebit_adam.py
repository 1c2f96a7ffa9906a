"""CompressedMomentumAdam's variance floor: Adam's own bound on each coordinate's step (Kingma & Ba, 2015,
Section 2.1), which a frozen variance breaks where a coordinate's gradients grew after the warm-up."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_bigtrain.engines.onebit_adam import CompressedMomentumAdam

_raise = CompressedMomentumAdam._raise_variance


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.9, 0.999), (0.5, 0.6), (0.0, 0.99)])
def test_the_floor_leaves_adams_own_variance_alone(betas):
    """For m and v averaging the same gradients (dense Adam), v already satisfies the bound: the floor changes
    nothing but the last bit where the bound is attained (step 1), whatever the gradients (noise, spikes, zeros,
    a growing run, the sequence that attains the bound)."""
    beta1, beta2 = betas
    gen = torch.Generator().manual_seed(0)
    n = 4096
    m, v = torch.zeros(n), torch.zeros(n)
    worst = torch.linspace(0, 1, n)  # the last columns follow the extremal sequence g_k ~ (beta1 / beta2)^-k
    for t in range(1, 301):
        g = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 4
        g[: n // 8] *= 1.0 + 20.0 * (t % 37 == 0)  # spikes
        g[n // 8 : n // 4] *= t % 5 == 0  # mostly zero
        g[-64:] = worst[-64:] * (beta2 / beta1 if beta1 else 1.0) ** min(t, 60)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        state = {"step": t, "exp_avg": m.clone(), "exp_avg_sq": v.clone(), "frozen_step": t}
        _raise(state, {"betas": betas})
        assert torch.allclose(state["exp_avg_sq"], v, rtol=1e-5, atol=0), t


def test_a_coordinate_with_a_stale_variance_steps_at_most_the_bound():
    """A frozen variance of zero (a token first seen after the warm-up) would make the step m / eps; with the floor
    the step is exactly Adam's bound, and a coordinate whose variance is current is untouched."""
    beta1, beta2 = 0.9, 0.95
    t, frozen = 40, 20
    m = torch.tensor([0.3, -0.3, 1e-3])
    v = torch.tensor([0.0, 0.0, 1.0])
    state = {"step": t, "exp_avg": m.clone(), "exp_avg_sq": v.clone(), "frozen_step": frozen}
    _raise(state, {"betas": (beta1, beta2)})
    m_hat = m / (1 - beta1**t)
    v_hat = state["exp_avg_sq"] / (1 - beta2**frozen)
    r = beta1**2 / beta2
    bound = (1 - beta1) / (1 - beta1**t) * math.sqrt((1 - beta2**t) / (1 - beta2) * (1 - r**t) / (1 - r))
    step = m_hat / v_hat.sqrt()
    assert step[:2].abs().tolist() == pytest.approx([bound, bound], rel=1e-6)
    assert 1.1 < bound < 1.2  # (0.9, 0.95): about 1.165 times the learning rate
    assert state["exp_avg_sq"][2] == 1.0


def test_the_variance_of_the_mean_is_recovered_from_the_ranks_second_moments():
    """Each rank measures E[g_i^2] = mu^2 + sigma^2; Adam's variance is that of the averaged gradient,
    E[g_bar^2] = mu^2 + sigma^2 / W. Over 4 ranks of signal-dominated, noise-dominated and mixed coordinates the
    estimate is within 3% of the averaged gradients' measured second moment, where the ranks' own mean (the estimate
    with no correction) is up to 4x too large; at one rank it is the second moment itself (Adam's own v)."""
    from lightning_bigtrain.engines.onebit_adam import _variance_of_the_mean

    gen = torch.Generator().manual_seed(0)
    world, samples = 4, 20000
    mu = torch.tensor([1.0, 0.0, 0.5, -2.0])
    sigma = torch.tensor([0.01, 1.0, 0.5, 1.0])
    g = mu + sigma * torch.randn(samples, world, 4, generator=gen)  # sample, rank, coordinate
    second = g.square().mean(dim=(0, 1))  # the ranks' mean second moment
    truth = g.mean(dim=1).square().mean(dim=0)  # the averaged gradient's
    estimate = _variance_of_the_mean(second.clone(), mu, world)
    assert torch.allclose(estimate, truth, rtol=0.03), (estimate, truth)
    assert (second / truth).max() > 3.5  # uncorrected: the noise counted W times
    assert torch.equal(_variance_of_the_mean(second.clone(), mu, 1), second)
    # A mean larger than the second moment allows (a momentum still carrying compression error) counts as signal
    # up to the second moment only: the estimate never exceeds what the ranks measured.
    assert torch.equal(_variance_of_the_mean(second.clone(), 10 * mu + 10, world), second)
