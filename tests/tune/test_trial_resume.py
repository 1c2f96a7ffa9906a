"""`TuneTrial` across a resume: the open report window and the validated metrics are checkpointed, so a trial killed
between two reports reports what the uninterrupted trial reports (the pruner sees the same curve)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bigtrain.callbacks import FaultTolerance
from lightning_bigtrain.data import FashionMNISTDataModule
from lightning_bigtrain.models import FashionCNN
from lightning_bigtrain.tune.trial import TuneTrial, open_storage
from tests.helpers.distributed import run_on_ranks

pytestmark = pytest.mark.integration

_NEVER = {"name": "threshold", "upper": 1e9}  # reports, never prunes


class _StopAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True  # the job ends here (as a killed one would have, after its checkpoint)


def _fit(folder: str, storage: str, trial_id: int, stop: int | None, ckpt: str | None) -> None:
    L.seed_everything(0, verbose=False)
    trial = TuneTrial(str(Path(folder, f"result-{trial_id}.json")), objectives=["step_time"], storage=storage,
                      study_name="s", trial_id=trial_id, pruner=_NEVER, report_every=4)  # fmt: skip
    callbacks: list[L.Callback] = [trial, FaultTolerance(), ModelCheckpoint(dirpath=folder, every_n_train_steps=6)]
    if stop is not None:
        callbacks.append(_StopAt(stop))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=12, limit_val_batches=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)  # fmt: skip
    trainer.fit(FashionCNN(channels=(4, 8, 8)), datamodule=FashionMNISTDataModule(batch_size=16, subset=512),
                ckpt_path=ckpt)  # fmt: skip


def _trials(rank: int, root: str, storage: str, ids: list[int]) -> None:
    whole, killed = ids
    _fit(str(Path(root, "whole")), storage, whole, None, None)
    _fit(str(Path(root, "killed")), storage, killed, 6, None)  # stopped after step 6's checkpoint, mid-window
    _fit(str(Path(root, "killed")), storage, killed, None, str(Path(root, "killed", "epoch=0-step=6.ckpt")))


def test_a_resumed_trial_reports_what_the_uninterrupted_trial_reports(tmp_path):
    import optuna

    storage = str(tmp_path / "study.log")
    study = optuna.create_study(study_name="s", storage=open_storage(storage))
    ids = [study.ask()._trial_id for _ in range(2)]
    run_on_ranks(_trials, str(tmp_path), storage, ids, init_process_group=False)
    whole, killed = (t.intermediate_values for t in optuna.load_study(study_name="s", storage=open_storage(
        storage)).get_trials())  # fmt: skip
    assert sorted(whole) == [4, 8, 12] and sorted(killed) == [4, 8, 12], (whole, killed)
    # Step 8's report averages steps 5-8 over both ranks, two of them trained before the resume.
    assert killed == whole, (killed, whole)
    assert all(torch.isfinite(torch.tensor(v)) for v in whole.values())
