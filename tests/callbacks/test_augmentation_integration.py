"""BatchAugmentation in a real Trainer: soft targets reach an unchanged training_step, the loss is mixed where the
targets cannot be, a datamodule's own transfer hook runs first, runs resume exactly, and what it cannot do is
refused naming the fix."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_bigtrain.callbacks import BatchAugmentation, FaultTolerance
from lightning_bigtrain.models import CharGPT

pytestmark = pytest.mark.integration

_QUIET = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False)  # fmt: skip


def _images(n: int = 64, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


class _Classifier(L.LightningModule):
    """A user's module: ``F.cross_entropy(self(x), y)``, a logged loss, and records of what it was given."""

    def __init__(self, loss: str = "ce", call_forward: bool = True) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 4))
        self.loss, self.call_forward = loss, call_forward
        self.seen: list[dict[str, Any]] = []
        self.val_targets: list[torch.Tensor] = []
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x) if self.call_forward else self.net(x)
        loss = F.nll_loss(out.log_softmax(-1), y) if self.loss == "nll" else F.cross_entropy(out, y)
        self.seen.append({"x": x.detach().clone(), "y": y.detach().clone(), "out": out.detach().clone(),
                          "loss": float(loss.detach())})  # fmt: skip
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_targets.append(batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Outputs(L.Callback):
    def __init__(self, augment: BatchAugmentation) -> None:
        self.augment = augment
        self.rows: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append((float(outputs["loss"]), self.augment._lam))


def _fit(module: L.LightningModule, augment: BatchAugmentation, steps: int = 4, **kwargs: Any) -> _Outputs:
    track = _Outputs(augment)
    trainer = L.Trainer(max_steps=steps, callbacks=[augment, track], **{**_QUIET, **kwargs})
    data = DataLoader(_images(), batch_size=16)
    trainer.fit(module, train_dataloaders=data, val_dataloaders=DataLoader(_images(16, 1), batch_size=16))
    return track


def test_soft_targets_reach_an_unchanged_training_step_and_validation_is_left_alone():
    module = _Classifier()
    _fit(module, BatchAugmentation(mixup=0.4, cutmix=1.0, erasing=0.25, num_classes=4), val_check_interval=2)
    assert len(module.seen) == 4 and module.forwards == 4  # one forward per step
    for step in module.seen:
        y = step["y"]
        assert y.shape == (16, 4) and y.dtype == torch.float32
        torch.testing.assert_close(y.sum(dim=1), torch.ones(16))
        assert (y.max(dim=1).values < 1).sum() >= 4  # samples mixed (a partner of the same class looks unmixed)
        assert y.max(dim=1).values.unique().numel() >= 4  # each with its own weight
    assert all(not t.is_floating_point() and t.shape == (16,) for t in module.val_targets)


def test_without_num_classes_the_loss_is_mixed_and_the_model_runs_once():
    module = _Classifier()
    track = _fit(module, BatchAugmentation(mixup=0.4, cutmix=1.0))
    assert module.forwards == 4 and len(module.seen) == 8  # training_step twice per step, forward once
    for i, (loss, lam) in enumerate(track.rows):
        a, b = module.seen[2 * i], module.seen[2 * i + 1]
        torch.testing.assert_close(a["out"], b["out"])  # the second run was answered from the first's output
        assert torch.equal(b["y"], torch.roll(a["y"], 1))  # the partners' targets
        assert 0.0 <= lam <= 1.0
        assert loss == pytest.approx(lam * a["loss"] + (1 - lam) * b["loss"], rel=1e-5)
    assert module.trainer.callback_metrics["train_loss"] == pytest.approx(track.rows[-1][0], rel=1e-5)  # mixed too


def test_what_cannot_be_mixed_is_refused_at_the_first_step_naming_the_fix():
    with pytest.raises(RuntimeError, match=r"never called the module's forward \(self\(x\)\). Pass num_classes="):
        _fit(_Classifier(call_forward=False), BatchAugmentation(mixup=0.2))
    with pytest.raises(RuntimeError, match="pass num_classes=None to mix the loss instead"):
        _fit(_Classifier(loss="nll"), BatchAugmentation(mixup=0.2, num_classes=4))
    with pytest.raises(ValueError, match=r"mixes floating-point inputs; these are torch.int64 \(token ids\?\)"):
        trainer = L.Trainer(max_steps=1, callbacks=[BatchAugmentation(mixup=0.2)], **_QUIET)
        trainer.fit(_gpt(), train_dataloaders=_tokens())


class _ShiftingData(L.LightningDataModule):
    """A datamodule with its own on_after_batch_transfer (it shifts the inputs by 100)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_images(), batch_size=16)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        return x + 100.0, y


def test_a_datamodules_own_transfer_hook_runs_first_without_lightnings_override_warning():
    module = _Classifier()
    augment = BatchAugmentation(mixup=0.4, num_classes=4)
    trainer = L.Trainer(max_steps=2, callbacks=[augment], limit_val_batches=0, **_QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=(data := _ShiftingData()))
    assert not [w for w in caught if "You have overridden `on_after_batch_transfer`" in str(w.message)]
    for step in module.seen:
        assert float(step["x"].min()) > 90  # shifted, then mixed: both happened, in that order
        assert step["y"].shape == (16, 4)
    assert "on_after_batch_transfer" not in vars(data)  # the wrapper is gone after fit
    assert "on_after_batch_transfer" not in vars(module)  # (the module's was never wrapped)


def test_a_run_resumed_mid_epoch_draws_what_the_uninterrupted_run_drew(tmp_path):
    def fit(resume: str | None) -> torch.Tensor:
        L.seed_everything(0, verbose=False)
        module = _Classifier()
        saves = [ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3, save_top_k=-1),
                 FaultTolerance()]  # mid-epoch data position  # fmt: skip
        augment = BatchAugmentation(mixup=0.4, cutmix=1.0, erasing=0.5, rand_augment=2, value_range=(-6.0, 6.0),
                                    num_classes=4)  # fmt: skip
        trainer = L.Trainer(max_steps=7, callbacks=[augment, *saves], limit_val_batches=0,
                            **{**_QUIET, "enable_checkpointing": True})  # fmt: skip
        trainer.fit(module, train_dataloaders=DataLoader(_images(), batch_size=16), ckpt_path=resume)
        return torch.cat([p.detach().flatten() for p in module.parameters()])

    whole = fit(None)
    resumed = fit(str(tmp_path / "step=3.ckpt"))  # batch 3 of 4: mid-epoch
    assert torch.equal(whole, resumed)


def test_until_leaves_the_last_steps_clean():
    module = _Classifier()
    _fit(module, BatchAugmentation(mixup=0.4, num_classes=4, until=0.5), limit_val_batches=0)
    assert [s["y"].dim() for s in module.seen] == [2, 2, 1, 1]


def _gpt() -> CharGPT:
    return CharGPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16, warmup_steps=1)


def _tokens() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(1, 16, (32, 9), generator=g)
    return DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=8)


class _SeenTokens(L.Callback):
    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.inputs.append(batch[0].clone())


def test_token_masking_masks_inputs_of_a_gpt_and_leaves_targets():
    seen = _SeenTokens()
    trainer = L.Trainer(max_steps=3, callbacks=[BatchAugmentation(token_mask=0.25, mask_token=0), seen], **_QUIET)
    trainer.fit(_gpt(), train_dataloaders=_tokens())
    share = float(torch.cat(seen.inputs).eq(0).float().mean())
    assert 0.15 < share < 0.35


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match="every augmentation off does nothing"):
        BatchAugmentation()
    with pytest.raises(ValueError, match=r"mixup=-1\)` is Beta's alpha"):
        BatchAugmentation(mixup=-1)
    with pytest.raises(ValueError, match=r"until=0.0\)` must lie in \(0, 1.0\]"):
        BatchAugmentation(mixup=0.2, until=0.0)
    with pytest.raises(ValueError, match="pass the id that masked tokens take"):
        BatchAugmentation(token_mask=0.1)
    with pytest.raises(ValueError, match="pass one kind"):
        BatchAugmentation(token_mask=0.1, mask_token=0, mixup=0.2)
    with pytest.raises(ValueError, match=r"num_classes=1\)`: pass an int >= 2"):
        BatchAugmentation(mixup=0.2, num_classes=1)
    with pytest.raises(ValueError, match=r"rand_augment=-1\)`: operations per sample"):
        BatchAugmentation(rand_augment=-1)
    with pytest.raises(ValueError, match=r"magnitude=31\)`: RandAugment's magnitude"):
        BatchAugmentation(rand_augment=2, magnitude=31)
    with pytest.raises(ValueError, match=r"value_range=\(1, 0\)\)`: pass \(black, white\)"):
        BatchAugmentation(rand_augment=2, value_range=(1, 0))
    with pytest.raises(ValueError, match="pass one kind"):
        BatchAugmentation(token_mask=0.1, mask_token=0, rand_augment=1)


def test_rand_augment_refuses_inputs_outside_value_range_at_the_first_step():
    """Standardised images with the default value_range (0, 1) would be clipped to black and white."""
    with pytest.raises(ValueError, match=r"inputs span \[-.*value_range=\(\(0 - mean\) / std"):
        _fit(_Classifier(), BatchAugmentation(rand_augment=2), limit_val_batches=0)
    module = _Classifier()
    _fit(module, BatchAugmentation(rand_augment=2, magnitude=15, value_range=(-6.0, 6.0)), limit_val_batches=0)
    assert len(module.seen) == 4 and all(s["y"].dim() == 1 for s in module.seen)  # targets untouched


def _two_ranks(rank: int, kd: bool) -> dict[str, Any]:  # kd=False: the mixed loss alone
    from lightning_bigtrain.callbacks import KnowledgeDistillation

    L.seed_everything(0, verbose=False)
    module = _Classifier()
    teacher = _Classifier()
    augment = BatchAugmentation(mixup=0.4, cutmix=1.0)  # the loss mixed, one forward, under DDP
    callbacks: list[Any] = [augment, *([KnowledgeDistillation(teacher, temperature=2.0, alpha=0.5)] if kd else [])]
    trainer = L.Trainer(strategy="ddp", max_steps=3, callbacks=callbacks, limit_val_batches=0,
                        **{**_QUIET, "devices": 2})  # fmt: skip
    trainer.fit(module, train_dataloaders=DataLoader(_images(), batch_size=8))
    weights = torch.cat([p.detach().flatten() for p in module.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(2)]
    torch.distributed.all_gather(gathered, weights)
    return {"equal": torch.equal(*gathered), "forwards": module.forwards, "calls": len(module.seen),
            "kd": "distill/kd_loss" in trainer.callback_metrics}  # fmt: skip


def test_under_ddp_with_distillation_the_model_runs_once_and_replicas_agree():
    """2 ranks: the mixed loss under DDP, composed with KnowledgeDistillation (whose teacher sees the mixed
    inputs): one forward per step, replicas identical."""
    from tests.helpers.distributed import run_on_ranks

    ranks = run_on_ranks(_two_ranks, True, init_process_group=False)
    assert all(r["equal"] and r["forwards"] == 3 and r["calls"] == 6 and r["kd"] for r in ranks), ranks
