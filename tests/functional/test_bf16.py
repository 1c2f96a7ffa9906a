"""Unit tests of the compensated bf16 step: rounding is unbiased, compensation tracks fp32."""

from __future__ import annotations

import pytest
import torch

from lightning_bigtrain.engines.compensated import CompensatedStep
from lightning_bigtrain.functional.bf16 import COMPENSATION_KEY, stochastic_round_


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour(sign):
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    x = torch.full((200_000,), sign * (1.0 + 0.3 * ulp))
    out = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_(out, x.clone(), torch.Generator().manual_seed(0))  # the value is used as scratch
    values = set(out.float().unique().tolist())
    assert values == {sign * 1.0, sign * (1.0 + ulp)}
    # The mean of 200k Bernoulli(0.3) roundings is within 5 standard errors of x.
    tolerance = 5 * ulp * (0.3 * 0.7 / x.numel()) ** 0.5
    assert abs(out.float().mean().item() - x[0].item()) < tolerance


def test_stochastic_rounding_keeps_exact_values_and_infinities():
    x = torch.tensor([1.0, -2.5, 0.0, float("inf"), -float("inf")])
    out = torch.empty_like(x, dtype=torch.bfloat16)
    stochastic_round_(out, x.clone(), torch.Generator().manual_seed(0))  # the value is used as scratch
    assert torch.equal(out.float(), x)


def _train(compensation: str | None, steps: int = 300) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    """AdamW (lr 1e-3) on bf16-representable weights in [1, 2), where every update (about 5e-4) is below
    half a bf16 unit (2^-8 = 0.0039); ``None`` is the fp32 reference."""
    g = torch.Generator().manual_seed(0)
    init = (1 + torch.rand(4096, generator=g)).bfloat16()
    w = torch.nn.Parameter(init.float() if compensation is None else init.clone())
    opt = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.0)
    if compensation is not None:
        CompensatedStep(opt, compensation, seed=1)  # type: ignore[arg-type]
    for _ in range(steps):
        w.grad = torch.randn(4096, generator=g).to(w.dtype) + 0.5
        opt.step()
    return w.detach().float(), opt


def test_compensation_tracks_the_fp32_trajectory():
    reference, _ = _train(None)
    moved = (reference - _train(None, steps=0)[0]).abs().mean()
    trained = {c: _train(c)[0] for c in ("none", "kahan", "stochastic")}
    error = {c: (w - reference).abs().mean() for c, w in trained.items()}
    # Round-to-nearest loses every update (measured: error = 100% of the distance moved); Kahan keeps ~16
    # bits (measured 1.4%); stochastic rounding is unbiased but adds a random walk (measured 18%, mean
    # error 0.3%).
    assert error["none"] > 0.9 * moved
    assert error["kahan"] < 0.05 * moved
    assert error["stochastic"] < 0.35 * moved
    assert abs((trained["stochastic"] - reference).mean()) < 0.02 * moved


def test_states_are_bf16_and_the_compensation_is_in_the_optimizer_state():
    _, opt = _train("kahan", steps=3)
    (state,) = opt.state.values()
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    assert state[COMPENSATION_KEY].dtype == torch.bfloat16
    assert COMPENSATION_KEY in opt.state_dict()["state"][0]


def test_chunked_step_equals_one_step():
    def run(chunk: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=g).bfloat16()) for n in (100, 7, 300)]
        opt = torch.optim.Adam(params, lr=1e-3)
        CompensatedStep(opt, "stochastic", seed=3, chunk_numel=chunk)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).bfloat16()
            opt.step()
        return [p.detach().clone() for p in params]

    for a, b in zip(run(1), run(1 << 20), strict=True):
        assert torch.equal(a, b)


def test_refuses_lbfgs_and_unknown_compensation():
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"cannot drive LBFGS"):
        CompensatedStep(torch.optim.LBFGS([w]), "kahan")
    with pytest.raises(ValueError, match=r"compensation='round'"):
        CompensatedStep(torch.optim.SGD([w], lr=0.1), "round")  # type: ignore[arg-type]
