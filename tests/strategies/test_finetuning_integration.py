"""Fine-tuning that changes which parameters train during the run, on 2 CPU ranks: Lightning's
``BackboneFinetuning`` (unfreezes a backbone at an epoch and adds it to the optimizer), a callback unfreezing
parameters already in the optimizer, and one freezing them. Each strategy either trains as one device does on the
whole batch, with identical replicas, or refuses with the reason: Lightning's DDP trains an unfrozen parameter
unreduced (each rank on its own half: the replicas drift apart, Lightning issue 20340), and the flat layouts (ZeRO
stages 1-2, DeepSpeed) left it untrained, or kept moving a frozen one."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning
from torch import nn

from lightning_bigtrain.compression import PowerSGD
from lightning_bigtrain.strategies import CompressedDDPStrategy
from tests.helpers.distributed import run_on_ranks
from tests.helpers.strategies import strategy

pytestmark = pytest.mark.integration


class _Finetuned(L.LightningModule):
    def __init__(self, flow: str) -> None:
        super().__init__()
        self.flow = flow
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)
        if flow == "unfreeze":
            self.backbone[0].requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.head(self.backbone(x)), y)

    def configure_optimizers(self):
        # BackboneFinetuning's recipe: only the trainable parameters; the others: every parameter.
        params = [p for p in self.parameters() if p.requires_grad] if self.flow == "backbone" else self.parameters()
        return torch.optim.AdamW(params, lr=0.01)


class _Flip(L.Callback):
    """At epoch 1: the first backbone layer trainable ("unfreeze") or frozen ("freeze")."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            pl_module.backbone[0].requires_grad_(pl_module.flow == "unfreeze")


def _fit(flow: str, strategy_: object, devices: int, rank: int = 0) -> list[torch.Tensor] | str:
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    if devices == 2:  # each rank its half of every 16-sample batch, so one device on whole batches is the reference
        dataset = torch.utils.data.Subset(dataset, list(range(rank, 64, 2)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=16 // devices)
    model = _Finetuned(flow)
    callbacks: list[L.Callback] = [_Flip()]
    if flow == "backbone":
        callbacks = [
            BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0, should_align=False)
        ]
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy_, max_epochs=2, callbacks=callbacks,
                        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer.fit(model, loader)
        except (ValueError, RuntimeError) as err:
            return f"{type(err).__name__}: {err}"
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def _on_ranks(rank: int, cases: list[tuple[str, str]]) -> dict[str, list[torch.Tensor] | str]:
    def make(name: str) -> object:
        return CompressedDDPStrategy(PowerSGD(rank=64)) if name == "compressed" else strategy(name)

    return {f"{name}/{flow}": _fit(flow, make(name), 2, rank) for name, flow in cases}


def test_strategies_follow_requires_grad_or_refuse():
    flows = ("backbone", "unfreeze", "freeze")
    cases = [(name, flow) for name in ("zero3", "compressed") for flow in flows]
    cases += [("zero1", "backbone"), ("zero2", "unfreeze"), ("ds2", "freeze")]
    results = run_on_ranks(_on_ranks, cases, init_process_group=False)
    reference = {flow: _fit(flow, "auto", 1) for flow in flows}
    for name in ("zero3", "compressed"):  # full-rank PowerSGD: exact here
        for flow in flows:
            ours, other = results[0][f"{name}/{flow}"], results[1][f"{name}/{flow}"]
            assert not isinstance(ours, str), ours
            assert all(torch.equal(a, b) for a, b in zip(ours, other, strict=True)), f"{name}/{flow}: replicas differ"
            for a, b in zip(ours, reference[flow], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name}/{flow}")
    refused = results[0]
    assert "ValueError: `BackboneFinetuning` under `ZeroStrategy(stage=1)`" in refused["zero1/backbone"]
    assert "`backbone.0.weight`, `backbone.0.bias` became trainable" in refused["zero2/unfreeze"]
    assert (
        "DeepSpeedZeroStrategy(stage=2)`: since setup, `backbone.0.weight`, `backbone.0.bias` were frozen"
        in (refused["ds2/freeze"])
    )
