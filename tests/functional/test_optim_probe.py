"""The optimizer probes: element-wise (flat slices step as the whole) and DTensor shards, asked of real optimizers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_bigtrain.functional import optim_probe
from lightning_bigtrain.functional.optim_probe import dtensor_step_error, slice_step_error
from tests.functional.test_flat_shard_integration import LambLike, Lion
from tests.helpers.distributed import run_on_ranks


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.ones(4, 3)), nn.Parameter(torch.ones(3))]


@pytest.mark.parametrize("cls", optim_probe.ELEMENTWISE_OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("foreach", [False, True])
def test_torch_elementwise_optimizers_pass_the_probe_itself(cls, foreach, monkeypatch):
    # The named classes skip the probe; here it runs on them, so the list is checked, not trusted.
    monkeypatch.setattr(optim_probe, "ELEMENTWISE_OPTIMIZERS", ())
    assert slice_step_error(cls(_params(), foreach=foreach)) is None


def test_an_unnamed_elementwise_optimizer_passes():
    assert slice_step_error(Lion(_params(), lr=1e-5)) is None


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda ps: torch.optim.Adafactor(ps, lr=1e-2), "differently from the whole parameter"),
        (lambda ps: torch.optim.Muon(ps[:1], lr=1e-2), "refuses a flat slice"),
        (lambda ps: torch.optim.LBFGS(ps), "differently from the whole parameter"),
        (lambda ps: LambLike(ps, lr=1e-5), "differently from the whole parameter"),  # small lr: still seen
    ],
    ids=["adafactor", "muon", "lbfgs", "lamb_like_subclass_of_adam"],
)
def test_optimizers_coupling_a_tensor_are_found(make, words):
    reason = slice_step_error(make(_params()))
    assert reason is not None and words in reason


def test_hugging_face_adafactor_is_found():
    from transformers.optimization import Adafactor

    reason = slice_step_error(Adafactor(_params(), lr=1e-2, relative_step=False, scale_parameter=False))
    assert reason is not None and "Adafactor" in reason


def test_the_probe_draws_no_random_numbers():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    slice_step_error(torch.optim.Adafactor(_params()))
    assert torch.equal(torch.get_rng_state(), before)


def _dtensor_verdicts(rank: int) -> dict[str, str | None]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    makers = {
        "adamw": lambda ps: torch.optim.AdamW(ps),
        "muon": lambda ps: torch.optim.Muon(ps[:1]),
        "adafactor": lambda ps: torch.optim.Adafactor(ps),
        "rprop": lambda ps: torch.optim.Rprop(ps),
    }
    out: dict[str, str | None] = {}
    for name, make in makers.items():
        out[name] = dtensor_step_error(make(_params()), mesh)
        out[name + "_flat"] = dtensor_step_error(make(_params()), mesh, flat=True) if name != "muon" else None
        out[name + "_plain"] = dtensor_step_error(make(_params()))  # no DTensors, no mesh: nothing to ask
    return out


@pytest.mark.integration
def test_dtensor_probe_agrees_on_every_rank_and_names_torch_error():
    results = run_on_ranks(_dtensor_verdicts)
    assert results[0] == results[1]
    verdicts = results[0]
    assert verdicts["adamw"] is None and verdicts["adamw_flat"] is None and verdicts["muon"] is None
    assert "placement" in verdicts["adafactor"]
    assert verdicts["rprop"] is not None and verdicts["rprop_flat"] is not None
    assert all(verdicts[name + "_plain"] is None for name in ("adamw", "muon", "adafactor", "rprop"))
