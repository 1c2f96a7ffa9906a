"""A resumed fit's logs continue the interrupted run's: the same ``version_N`` folder, the rows and events logged
after the checkpoint replaced by the resumed run's, so that the CSV and TensorBoard logs of a run killed and
resumed are those of the uninterrupted run."""

from __future__ import annotations

import csv
import struct
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

from lightning_bigtrain.callbacks import FaultTolerance
from lightning_bigtrain.strategies import ZeroStrategy
from lightning_bigtrain.warnings import BigtrainWarning
from tests.helpers.tiny import TinyRegression

pytestmark = pytest.mark.usefixtures("in_process_fit")


class _Killed(Exception):
    """The job killed at the start of a batch, some steps after its last checkpoint."""


class _Logged(TinyRegression):
    """Logs a step loss, its epoch mean, and a validation loss; ``kill_at``: raise at the start of that step's
    batch (the loggers keep what they wrote: the CSV flushed every row)."""

    def __init__(self, kill_at: int | None = None) -> None:
        super().__init__()
        self.kill_at = kill_at

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.global_step == self.kill_at:
            raise _Killed

    def validation_step(self, batch, batch_idx) -> None:
        self.log("val_loss", self.loss(batch))


def _fit(root: Path, strategy: str, kill_at: int | None, ckpt_path: str | None, checkpoint: dict, trainer_kwargs: dict):
    L.seed_everything(0, verbose=False)
    model = _Logged(kill_at)
    # Event files are named by the second they are opened in: the suffix keeps a relaunch in the same second apart.
    suffix = ".a-killed" if kill_at is not None else ".b-resumed" if ckpt_path else ".fit"
    loggers = [TensorBoardLogger(root, name="tb", version=0, filename_suffix=suffix),
               CSVLogger(root, name="csv", version=0, flush_logs_every_n_steps=1)]  # fmt: skip
    trainer_kwargs = {"max_epochs": 3, **trainer_kwargs}
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=1) if strategy == "zero1" else "ddp",
        logger=loggers, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, deterministic=True,
        callbacks=[*([FaultTolerance()] if strategy == "ddp" else []),
                   ModelCheckpoint(dirpath=root / "checkpoints", save_last=True, **checkpoint)],
        **trainer_kwargs,
    )  # fmt: skip
    if kill_at is None:
        trainer.fit(model, ckpt_path=ckpt_path)
    else:
        with pytest.raises(_Killed):
            trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def _csv_rows(root: Path) -> list[dict[str, str]]:
    """The CSV log's rows, less ZeroStrategy's memory report: each fit logs its own at its first step."""
    with open(root / "csv" / "version_0" / "metrics.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if not row.get("zero/rank0_params_bytes")]


def _events(path: Path):
    from tensorboardX.proto.event_pb2 import Event

    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        yield Event.FromString(data[offset + 12 : offset + 12 + length])
        offset += 12 + length + 4


def _scalars(root: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars TensorBoard shows: its reader's order (the event files by name), a ``SessionLog.START`` at step s
    hiding every earlier event of step s or later (``purge_orphaned_data``)."""
    from tensorboardX.proto.event_pb2 import SessionLog

    series: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((root / "tb" / "version_0").glob("events.out.tfevents.*")):
        for event in _events(path):
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                series = {tag: [(s, v) for s, v in points if s < event.step] for tag, points in series.items()}
            for value in event.summary.value:
                series.setdefault(value.tag, []).append((event.step, value.simple_value))
    # The same point twice is drawn once: the validation logged at the checkpoint's step is (see _resume_logs).
    return {tag: list(dict.fromkeys(points)) for tag, points in series.items() if not tag.startswith("zero/rank0_")}


@pytest.mark.parametrize(
    ("trainer_kwargs", "checkpoint", "kill_at"),
    [
        pytest.param({"val_check_interval": 2}, {"every_n_train_steps": 4}, 7, id="mid-epoch-validation-after-it"),
        pytest.param({}, {}, 9, id="epoch-end"),
    ],
)
@pytest.mark.parametrize("strategy", ["zero1", "ddp"])
def test_the_logs_of_a_killed_and_resumed_run_are_the_uninterrupted_runs(
    tmp_path, trainer_kwargs, checkpoint, kill_at, strategy
):
    """Killed some steps after its last checkpoint (mid-epoch, the validation due right after the checkpoint; or at
    an epoch's end, the epoch's mean logged after it), resumed in the same version folder: TensorBoard shows the
    uninterrupted run's points, and under this package's strategies the CSV log holds the uninterrupted run's rows.
    Under Lightning's strategies (``FaultTolerance``) Lightning deletes the relaunch's ``metrics.csv`` before any
    callback runs (``bigtrain fit --resume auto`` keeps it: tests/test_cli.py)."""
    _fit(tmp_path / "ref", strategy, None, None, checkpoint, trainer_kwargs)
    _fit(tmp_path / "run", strategy, kill_at, None, checkpoint, trainer_kwargs)
    killed = _csv_rows(tmp_path / "run")
    _fit(tmp_path / "run", strategy, None, "last", checkpoint, trainer_kwargs)
    reference, resumed = _csv_rows(tmp_path / "ref"), _csv_rows(tmp_path / "run")
    assert any(int(row["step"]) >= kill_at - 2 for row in killed)  # it logged past its checkpoint
    if strategy == "zero1":
        assert resumed == reference
    assert _scalars(tmp_path / "run") == _scalars(tmp_path / "ref")


def test_a_fresh_fit_in_a_used_version_folder_starts_a_new_log(tmp_path):
    """Not resuming, a fit logging into a used folder replaces its CSV log, as Lightning does (the old log stays
    until the fit is under way: a fit that fails in its setup leaves it)."""
    _fit(tmp_path / "ref", "zero1", None, None, {}, {"max_epochs": 1})
    _fit(tmp_path / "run", "zero1", None, None, {}, {})
    with pytest.warns(BigtrainWarning, match="does not resume from a checkpoint and starts a new one"):
        _fit(tmp_path / "run", "zero1", None, None, {}, {"max_epochs": 1})
    assert _csv_rows(tmp_path / "run") == _csv_rows(tmp_path / "ref")
