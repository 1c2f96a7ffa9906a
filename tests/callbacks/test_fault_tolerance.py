"""FaultTolerance under Lightning's own DDP (one process here; two ranks in tests/test_chaos_integration.py)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_bigtrain.callbacks import EXIT_PREEMPTED, FaultTolerance, Preempted
from lightning_bigtrain.checkpointing import AtomicCheckpointIO, is_committed
from lightning_bigtrain.data import FashionMNISTDataModule
from lightning_bigtrain.models import FashionCNN
from lightning_bigtrain.strategies import ZeroStrategy
from lightning_bigtrain.warnings import NoEffectWarning
from tests.helpers.tiny import TinyRegression

pytestmark = pytest.mark.usefixtures("in_process_fit")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"SIGKILL cannot be caught"):
        FaultTolerance(signals=["SIGKILL"])
    with pytest.raises(ValueError, match=r"'SIGNOPE' is not a signal name"):
        FaultTolerance(signals=["SIGNOPE"])
    with pytest.raises(ValueError, match=r"pass a list of names"):
        FaultTolerance(signals="SIGTERM")  # type: ignore[arg-type]


def test_under_this_packages_strategies_it_warns_that_it_is_not_needed():
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(3), logger=False)
    with pytest.warns(NoEffectWarning, match=r"has no effect with ZeroStrategy"):
        FaultTolerance().setup(trainer, FashionCNN(channels=(4, 8)), "fit")
    assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)  # on by default there


class _StopAt(L.Callback):
    """Ends the fit after ``step`` optimizer steps (after that step's checkpoint), the run's plan unchanged."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


class _SignalAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class _StatefulFashion(FashionMNISTDataModule):
    """A user's own stateful loader as torchdata documents it for distributed runs: StatefulDataLoader with its
    StatefulDistributedSampler, and worker processes."""

    def train_dataloader(self):
        from torchdata.stateful_dataloader import StatefulDataLoader
        from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

        self.setup()
        data, trainer = self._splits["train"], self.trainer
        sampler = StatefulDistributedSampler(data, num_replicas=trainer.world_size, rank=trainer.global_rank, seed=0)
        return StatefulDataLoader(data, batch_size=self.batch_size, sampler=sampler, num_workers=2)


def _fit(tmp_path, *extra_callbacks, ckpt_path=None, max_epochs=2, data=FashionMNISTDataModule):
    L.seed_everything(0, verbose=False)
    model = FashionCNN(channels=(4, 8))
    ft = FaultTolerance()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy="ddp", max_epochs=max_epochs, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
        callbacks=[ft, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_last=True),
                   *extra_callbacks],
    )  # fmt: skip
    trainer.fit(model, datamodule=data(batch_size=16, subset=96), ckpt_path=ckpt_path)
    return trainer, model


def test_sigterm_commits_a_mid_epoch_checkpoint_exits_75_and_the_resume_is_exact(tmp_path):
    _, reference = _fit(tmp_path / "ref")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as stopped:
        _fit(tmp_path / "run", _SignalAt(3))
    assert stopped.value.code == EXIT_PREEMPTED == 75
    last = tmp_path / "run" / "ckpt" / "last.ckpt"
    assert (
        is_committed(last) and torch.load(last, weights_only=False)["global_step"] == 4
    )  # the next batch end; 6 per epoch
    assert signal.getsignal(signal.SIGTERM) == before, "the process's own handler is put back"
    trainer, resumed = _fit(tmp_path / "run", ckpt_path="last")
    assert type(trainer.strategy.checkpoint_io) is TorchCheckpointIO, "the strategy's own IO is put back"
    for a, b in zip(reference.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_users_stateful_dataloader_keeps_its_own_state(tmp_path):
    """torchdata's StatefulDataLoader (2 workers) is left to its own state_dict, which Lightning restores; the
    mid-epoch resume is exact (its state reaches it although configure_optimizers built the loaders early)."""
    trainer, reference = _fit(tmp_path / "ref", data=_StatefulFashion)
    assert not hasattr(trainer.train_dataloader, "_bigtrain_resumable")
    with pytest.raises(Preempted):
        _fit(tmp_path / "run", _SignalAt(3), data=_StatefulFashion)
    _, resumed = _fit(tmp_path / "run", ckpt_path="last", data=_StatefulFashion)
    for a, b in zip(reference.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_lightning_fsdp_sharded_checkpoints_are_committed_and_resume(tmp_path):
    """Lightning's FSDPStrategy (GPU only) writes sharded folders: under FaultTolerance each is committed with a
    manifest and named by a link, and a resume from it continues where the uninterrupted run ends."""
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_bigtrain.data import ShakespeareDataModule
    from lightning_bigtrain.models import CharGPT

    def fit(folder: Path, stop: int | None, ckpt_path: str | None) -> L.LightningModule:
        L.seed_everything(0, verbose=False)
        model = CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=32)
        # Every run plans 6 steps: CharGPT's learning-rate schedule is laid out over `estimated_stepping_batches`, so
        # an interrupted run that planned 3 (as this test did) trains its first steps at other learning rates and
        # cannot end where the uninterrupted one does (the 0.0117 the H200 measured). It stops after step 3's
        # checkpoint instead, as a killed job would.
        stopper = [_StopAt(stop)] if stop is not None else []
        trainer = L.Trainer(
            accelerator="cuda", devices=1, strategy=FSDPStrategy(state_dict_type="sharded"), max_steps=6,
            deterministic="warn", limit_val_batches=0, logger=False, enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[FaultTolerance(), ModelCheckpoint(dirpath=folder, every_n_train_steps=3, save_last=True),
                       *stopper],
        )  # fmt: skip
        trainer.fit(model, datamodule=ShakespeareDataModule(block_size=32, batch_size=8, subset=96),
                    ckpt_path=ckpt_path)  # fmt: skip
        assert trainer.global_step == (stop or 6)
        return model

    reference = fit(tmp_path / "ref", None, None)
    fit(tmp_path / "run", 3, None)  # the interrupted run: its own folder (a shared one holds the reference's last)
    assert is_committed(tmp_path / "run" / "last.ckpt") and os.path.islink(tmp_path / "run" / "last.ckpt")
    resumed = fit(tmp_path / "run", None, "last")
    for a, b in zip(reference.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)


class _Seen(L.LightningModule):
    """Records the samples of every step (the dataset holds the sample indices)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append([int(i) for i in batch])
        return self.layer(batch.float()[:, None]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(12)), batch_size=4)


def test_resume_after_an_epoch_boundary_checkpoint_does_not_replay_the_next_epoch(tmp_path):
    """Lightning alone: a run resumed from a checkpoint saved after an epoch's last batch, checkpointed again
    mid-epoch and resumed from that, replays the epoch (11 steps instead of 9). FaultTolerance repairs the epoch
    progress Lightning leaves behind."""

    def run(max_steps: int, ckpt_path: str | None) -> list[list[int]]:
        model = _Seen()
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy="ddp", max_epochs=3, max_steps=max_steps, logger=False,
            enable_progress_bar=False, enable_model_summary=False,
            callbacks=[FaultTolerance(), ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2,
                                                         save_last=True)],
        )  # fmt: skip
        L.seed_everything(0, verbose=False)
        trainer.fit(model, ckpt_path=ckpt_path)
        return model.seen

    uninterrupted = run(-1, None)
    shutil.rmtree(tmp_path / "ckpt")
    pieces = run(6, None) + run(8, "last") + run(-1, "last")  # 6: the last batch of epoch 1
    assert len(uninterrupted) == 9 and pieces == uninterrupted


_EXIT_SCRIPT = """
import atexit, sys
import lightning as L
import torch.distributed as dist
from lightning_bigtrain.data import FashionMNISTDataModule
from lightning_bigtrain.models import FashionCNN
from lightning_bigtrain.strategies import ZeroStrategy

# Registered first, so it runs after the hooks registered during the fit (atexit runs them last-in, first-out).
atexit.register(lambda: print("group alive at exit:", dist.is_initialized(), flush=True))
trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2), max_steps=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0)
trainer.fit(FashionCNN(channels=(4, 8, 8)), datamodule=FashionMNISTDataModule(batch_size=8, subset=32))
print("group alive after fit:", dist.is_initialized(), flush=True)
"""


def test_the_process_group_is_destroyed_at_exit_when_the_run_left_it():
    """A process that exits with its gloo group alive can abort in finalization ("terminate called without an active
    exception", pytorch#190489): a finished job then reports SIGABRT. The strategy destroys the group at exit."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "group alive after fit: True" in done.stdout  # Lightning leaves it (a second fit may reuse it)
    assert "group alive at exit: False" in done.stdout, done.stdout


class _Crash(Exception):
    """A job killed right after a checkpoint's commit."""


class _Validated(TinyRegression):
    """Records its validations and epoch ends (global step at each); an epoch-interval StepLR and a plateau scheduler
    on a constant validation metric (it lowers the learning rate at every update after the first; per epoch, or
    every 2 steps with ``plateau="step"``) both act on the learning rate. ``crash_at``: raise in the first hook after
    the checkpoint of that step (armed while it is written), before anything else of the run happens."""

    def __init__(self, crash_at: int | None = None, plateau: str = "epoch") -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []
        self.crash_at = crash_at
        self.plateau = plateau
        self._armed = False

    def on_save_checkpoint(self, checkpoint) -> None:
        self._armed = self.global_step == self.crash_at

    def _next(self, event: str | None = None) -> None:
        if self._armed:
            raise _Crash(event)
        if event is not None:
            self.events.append((event, self.global_step))

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._next()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._next()

    def validation_step(self, batch, batch_idx) -> None:
        self.log("constant", 1.0)

    def on_validation_start(self) -> None:
        self._next("validation")

    def on_validation_end(self) -> None:
        self._next()

    def on_train_epoch_start(self) -> None:
        self._next()

    def on_train_epoch_end(self) -> None:
        self._next("epoch end")

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        step = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", patience=0, factor=0.5)
        every = {"interval": "step", "frequency": 2} if self.plateau == "step" else {"interval": "epoch"}
        return [optimizer], [{"scheduler": step, "interval": "epoch"},
                             {"scheduler": plateau, "monitor": "constant", **every}]  # fmt: skip


@pytest.mark.parametrize(
    ("trainer_kwargs", "checkpoint_kwargs", "plateau", "crash_at"),
    [
        pytest.param({"val_check_interval": 2}, {"every_n_train_steps": 2}, "epoch", 4, id="validation-mid-epoch"),
        pytest.param(
            {"val_check_interval": 4, "accumulate_grad_batches": 2},
            {"every_n_train_steps": 1},
            "epoch",
            2,
            id="accumulating",
        ),
        pytest.param({}, {"every_n_train_steps": 3}, "epoch", 6, id="last-batch-of-the-epoch"),
        pytest.param({}, {}, "epoch", 6, id="default-checkpoint-at-the-epoch-end"),
        pytest.param(
            {"val_check_interval": 2},
            {"monitor": "constant", "save_top_k": -1},
            "step",
            4,
            id="metric-checkpoint-mid-epoch",
        ),
    ],
)
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_a_resume_runs_what_was_due_after_its_checkpoint(
    tmp_path, trainer_kwargs, checkpoint_kwargs, plateau, crash_at, strategy
):
    """A checkpoint is written inside a hook; what comes after it in the uninterrupted run must happen in the
    resumed one. ``ModelCheckpoint(every_n_train_steps=...)`` writes at the end of a training batch, before the
    validation due after it, the plateau step and, after an epoch's last batch, the epoch's end: Lightning alone,
    resuming, skipped them (and the plateau step at the end of the epoch a run resumed in). The default
    ``ModelCheckpoint()`` writes in ``on_train_epoch_end``, before the epoch's plateau step: skipped. A
    metric-monitoring one writes in ``on_validation_end``, before that batch's plateau step: taken without the metric,
    which is in no checkpoint (``strict``: the resume failed). Here every validation and epoch end happens once, in
    order, across the crashed and the resumed job, and the run ends with the uninterrupted one's weights and learning
    rate. Under ZeroStrategy, SGD without momentum is saved without per-parameter state: its learning rate was not
    restored either (the folder was taken for a weights-only one)."""

    def fit(folder: Path, crash_at: int | None, ckpt_path: str | None) -> tuple[L.Trainer, _Validated]:
        L.seed_everything(0, verbose=False)
        model = _Validated(crash_at, plateau)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=1) if strategy == "zero1" else "ddp",
            max_epochs=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[*([FaultTolerance()] if strategy == "ddp" else []),
                       ModelCheckpoint(dirpath=folder, save_last=True, **checkpoint_kwargs)],
            **trainer_kwargs,
        )  # fmt: skip
        if crash_at is None:
            trainer.fit(model, ckpt_path=ckpt_path)
        else:
            with pytest.raises(_Crash):
                trainer.fit(model, ckpt_path=ckpt_path)
        return trainer, model

    reference_trainer, reference = fit(tmp_path / "ref", None, None)
    _, crashed = fit(tmp_path / "run", crash_at, None)
    trainer, resumed = fit(tmp_path / "run", None, "last")
    assert crashed.events + resumed.events == reference.events
    assert trainer.optimizers[0].param_groups[0]["lr"] == reference_trainer.optimizers[0].param_groups[0]["lr"]
    for a, b in zip(reference.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
