"""Gradient norms as a Lightning user logs them (``grad_norm(self, 2)`` in ``on_before_optimizer_step``), under every
data-parallel strategy on 2 CPU ranks: ``lightning_bigtrain.utilities.grad_norm`` returns Lightning's numbers under
DDP, where Lightning's own returns other numbers (ZeRO-1: each rank's slices only), nothing (ZeRO-2, DeepSpeed) or an
error (ZeRO-3's DTensor gradients). Tensor and pipeline parallelism: test_tensor_parallel_integration.py and
test_pipeline_integration.py."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities import grad_norm as lightning_grad_norm
from torch import nn

from lightning_bigtrain.utilities import grad_norm
from tests.helpers.distributed import run_on_ranks
from tests.helpers.strategies import strategy

pytestmark = pytest.mark.integration

_QUIET = dict(accelerator="cpu", devices=2, max_steps=2, accumulate_grad_batches=2, use_distributed_sampler=False,
              logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False)  # fmt: skip
_NAMES = ["ddp", "zero1", "zero2", "zero3", "ds1", "ds2", "ds3"]


class _Net(L.LightningModule):
    def __init__(self, ours: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ours = ours
        self.net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        self.net[0].weight.requires_grad_(False)  # frozen: no key, as in Lightning's
        self.norms: list[dict[str, float]] = []
        self.lightnings: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if not self.ours:  # the reference: Lightning's own under its DDP
            self.norms.append({k: float(v) for k, v in lightning_grad_norm(self, 2).items()})
            return
        both = {**grad_norm(self, 2), **grad_norm(self, "inf")}
        if both:  # (DeepSpeed: the micro-batches before the last get none; see grad_norm)
            self.norms.append({k: float(v) for k, v in both.items()})
        try:
            self.lightnings.append(len(lightning_grad_norm(self, 2)))
        except RuntimeError as err:  # ZeRO-3: Lightning's stacks DTensors into a tensor
            self.lightnings.append(type(err).__name__)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _data(rank: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    return torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, range(rank, 64, 2)), batch_size=4)


def _fits(rank: int) -> dict[str, Any]:
    from lightning_bigtrain import warnings as bigtrain_warnings

    out = {}
    for name in ["reference", *_NAMES]:
        model = _Net(ours=name != "reference")
        trainer = L.Trainer(strategy=strategy("ddp" if name == "reference" else name), **_QUIET)
        bigtrain_warnings._seen.clear()  # (once per process: an earlier task in this rank may have said it)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model, _data(rank))
        said = [str(w.message) for w in caught if issubclass(w.category, bigtrain_warnings.NoEffectWarning)]
        out[name] = {"norms": model.norms, "lightning": model.lightnings,
                     "warned": [m for m in said if "`_Net.on_before_optimizer_step` uses" in m]}  # fmt: skip
    return out


def test_grad_norm_gives_lightnings_ddp_numbers_under_every_strategy():
    results = run_on_ranks(_fits, init_process_group=False)
    reference = results[0]["reference"]["norms"]
    assert len(reference) == 2 and len(reference[0]) == 6  # 5 trainable tensors and the total
    for name in _NAMES:
        got = results[0][name]["norms"]
        assert results[1][name]["norms"] == got, name  # every rank gets every key, the same values
        assert len(got) == 2, (name, got)
        for expected, step in zip(reference, got, strict=True):
            twos = {k: v for k, v in step.items() if k.startswith("grad_2.0")}
            assert twos.keys() == expected.keys(), name
            for key, value in expected.items():
                assert twos[key] == pytest.approx(value, rel=1e-5), (name, key)
            infs = [v for k, v in step.items() if k.startswith("grad_inf_norm/")]
            assert step["grad_inf_norm_total"] == max(infs) > 0, name
    assert results[0]["ddp"]["norms"][0]["grad_inf_norm/net.2.weight"] == pytest.approx(
        results[0]["zero3"]["norms"][0]["grad_inf_norm/net.2.weight"], rel=1e-6
    )
    # What Lightning's own grad_norm gives: keys at ZeRO-1 (other values), none at ZeRO-2 and at DeepSpeed's steps.
    lightning = {name: results[0][name]["lightning"] for name in _NAMES}
    assert lightning["ddp"] == lightning["zero1"] == [6, 6]
    assert lightning["zero2"] == [0, 0] and lightning["zero3"] == ["RuntimeError"] * 2
    assert lightning["ds2"] == lightning["ds3"] == [0] * 4  # (the hook runs on every micro-batch under DeepSpeed)
    assert lightning["ds1"] == [6, 0, 6, 0]  # stage 1: each rank's own gradient before the last micro-batch
    # The hook's use of Lightning's grad_norm is pointed out at setup where it gives other numbers or none (rank 0).
    warned = {name: results[0][name]["warned"] for name in _NAMES}
    assert {name for name, said in warned.items() if said} == {"zero1", "zero2", "ds1", "ds2", "ds3"}, warned
    assert (
        "uses Lightning's `grad_norm`: under `ZeroStrategy(stage=2)` the module's `param.grad` is None"
        in (warned["zero2"][0])
    )
    assert not results[0]["reference"]["warned"] and not any(results[1][name]["warned"] for name in _NAMES)


def test_grad_norm_on_one_process_is_lightnings_and_refuses_a_bad_norm_type():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model[2].bias.requires_grad_(False)
    model(torch.randn(4, 8)).sum().backward()
    for p in (1, 2, 3.5, "inf"):
        ours, theirs = grad_norm(model, p), lightning_grad_norm(model, p)
        assert ours.keys() == theirs.keys()
        for key in theirs:
            torch.testing.assert_close(ours[key], theirs[key].float(), rtol=1e-6, atol=0)
    assert grad_norm(nn.Linear(2, 2), 2) == {}  # no gradients yet
    with pytest.raises(ValueError, match=r"grad_norm\(norm_type=0.0\).*positive"):
        grad_norm(model, 0)


def test_a_modules_own_clipping_is_pointed_out_where_its_gradients_are_parts():
    """What the warning looks for: torch's norm functions (by name, attribute or alias), element-wise clipping only
    where the gradients are absent, Lightning's ``grad_norm`` but not ours, in overridden hooks only."""
    from torch.nn.utils import clip_grad_norm_ as clip

    from lightning_bigtrain import warnings as bigtrain_warnings
    from lightning_bigtrain.strategies._common import warn_own_gradient_reads

    class ByAttribute(L.LightningModule):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)

    class ByAlias(L.LightningModule):
        def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
            clip(self.parameters(), 1.0)

    class ByValue(L.LightningModule):
        def on_after_backward(self) -> None:
            torch.nn.utils.clip_grad_value_(self.parameters(), 1.0)

    class Ours(L.LightningModule):
        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.log_dict(grad_norm(self, 2))
            self.clip_gradients(optimizer, gradient_clip_val=1.0)

    class Manual(L.LightningModule):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            def inner() -> Any:  # a function defined in the hook
                return lightning_grad_norm(self, 2)

            inner()

    def said(module: L.LightningModule, absent: bool) -> list[str]:
        bigtrain_warnings._seen.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warn_own_gradient_reads(module, "ZeroStrategy(stage=1)", "parts", absent=absent)
        return [str(w.message) for w in caught if issubclass(w.category, bigtrain_warnings.NoEffectWarning)]

    assert "`ByAttribute.on_before_optimizer_step` uses `clip_grad_norm_`" in said(ByAttribute(), absent=False)[0]
    assert "`ByAlias.configure_gradient_clipping` uses `clip_grad_norm_`" in said(ByAlias(), absent=False)[0]
    assert said(ByValue(), absent=False) == []  # element-wise: right on each rank's slices
    assert "`ByValue.on_after_backward` uses `clip_grad_value_`" in said(ByValue(), absent=True)[0]
    assert said(Ours(), absent=True) == []
    message = said(Manual(), absent=False)[0]
    assert "`Manual.training_step` uses Lightning's `grad_norm`" in message and "self.clip_gradients(" in message


class _AdamNet(_Net):
    def __init__(self) -> None:
        super().__init__(ours=True)
        self.phases: list[bool] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.phases.append(bool(getattr(self.trainer.optimizers[0], "compressing", False)))
        super().on_before_optimizer_step(optimizer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=0.01)


def _onebit(rank: int) -> dict[str, Any]:
    from lightning_bigtrain import warnings as bigtrain_warnings
    from lightning_bigtrain.compression import OneBitAdam
    from lightning_bigtrain.strategies import CompressedDDPStrategy

    model = _AdamNet()
    kwargs = {**_QUIET, "max_steps": 3, "accumulate_grad_batches": 1}
    trainer = L.Trainer(strategy=CompressedDDPStrategy(OneBitAdam(warmup_steps=2)), **kwargs)
    bigtrain_warnings._seen.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _data(rank))
    said = [str(w.message) for w in caught if "1-bit Adam's warm-up" in str(w.message)]
    return {"phases": model.phases, "said": said, "norms": len(model.norms)}


def test_grad_norm_after_one_bit_adams_warm_up_says_the_norms_are_local():
    """After the warm-up no gradient is averaged (each rank steps on its own and exchanges compressed momentum): the
    norms are the rank's local ones, and ranks log different numbers. It said nothing; now it says so, once, on rank
    0 (the warm-up's steps, with averaged gradients, stay silent)."""
    ranks = run_on_ranks(_onebit, init_process_group=False)
    for rank, r in enumerate(ranks):
        assert r["phases"] == [False, False, True] and r["norms"] == 3
        assert len(r["said"]) == (1 if rank == 0 else 0), r["said"]
