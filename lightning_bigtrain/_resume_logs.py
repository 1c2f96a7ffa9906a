"""A resumed fit's logs continue the interrupted run's, in the same ``version_N`` folder, without what it logged
after the checkpoint.

Lightning's ``TensorBoardLogger`` and ``CSVLogger`` start a new ``version_N`` folder at every launch unless their
``version`` is fixed, and ``ModelCheckpoint`` without a ``dirpath`` keeps its checkpoints in that folder: a
relaunch neither finds the killed run's checkpoints nor continues its curves. With a fixed ``version`` the
relaunch logs into the same folder, but ``CSVLogger`` deletes the folder's ``metrics.csv`` (the whole history) and
TensorBoard shows both the killed run's events after the checkpoint and the resumed run's at the same steps.

Here, where a fit resumes:

* :func:`newest_run_checkpoint` (``bigtrain fit --resume auto``): without a ``ModelCheckpoint(dirpath=...)``, the
  newest committed checkpoint in the newest ``version_N`` folder of the first logger that holds one, and the
  versioned loggers of unset ``version`` continue that folder.
* :func:`keep_csv_history` (before the loggers create their writers: this package's strategies'
  ``setup_environment``, the CLI): a ``CSVLogger`` continuing a folder keeps its ``metrics.csv`` until
  :func:`continue_logs` (``on_train_start``) decides what stays: on a resume the rows up to the checkpoint's logging
  step, on a fresh start none (Lightning's deletion, done once the fit is under way).
* :func:`continue_logs`: rows logged after the checkpoint are removed; a row the resumed run logs again at the
  checkpoint's own step (the validation due after it) replaces the interrupted run's row with the same columns.
  TensorBoard gets a ``SessionLog.START`` event at the first step after the checkpoint, TensorBoard's own
  ``purge_step`` record: events of the interrupted run from that step on are hidden.

The checkpoint's logging step is Lightning's ``_batches_that_stepped`` as saved (the step its logger calls carry).
A checkpoint written at a batch's end precedes that batch's step metrics, which the resumed run does not log
again: they stay. On TensorBoard the validation logged at that step appears twice (the interrupted run's and the
resumed run's, the same values when the run is deterministic).
"""

from __future__ import annotations

import csv
import io
import os
import re
import time
from typing import Any

from lightning_bigtrain._compat import (
    csv_writer_keeping_files,
    logger_filesystem,
    logger_version,
    logger_writer_created,
    logging_step,
    set_logger_version,
)
from lightning_bigtrain.warnings import BigtrainWarning, warn_once

__all__ = ["continue_logs", "keep_csv_history", "newest_run_checkpoint"]

_KEPT = "_bigtrain_kept_history"  # set on a CSV writer whose folder's metrics.csv was kept for the fit to decide
_VERSION = re.compile(r"version_(\d+)$")


def _versioned(logger: Any) -> bool:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    return isinstance(logger, CSVLogger | TensorBoardLogger)


def _root(logger: Any, trainer: Any) -> str:
    """The folder of a versioned logger's ``version_N`` folders (as ``ModelCheckpoint`` resolves it)."""
    save_dir = logger.save_dir or trainer.default_root_dir
    return os.path.join(str(save_dir), str(logger.name)) if logger.name else str(save_dir)


def _versions(fs: Any, root: str) -> list[int]:
    """The ``version_N`` folders of ``root``, newest (largest N) first."""
    try:
        entries = fs.ls(root, detail=False) if fs.isdir(root) else []
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        match = _VERSION.match(os.path.basename(str(entry).rstrip("/")))
        if match and fs.isdir(entry):
            found.append(int(match.group(1)))
    return sorted(found, reverse=True)


def newest_run_checkpoint(trainer: Any) -> tuple[bool, str | None]:
    """Where ``--resume auto`` continues when ``ModelCheckpoint`` has no ``dirpath`` and its checkpoints live in the
    first logger's version folder: ``(True, path)`` for the newest committed checkpoint there (``last*`` preferred),
    ``(True, None)`` when no version folder holds one (a fresh start), ``(False, None)`` when the first logger is
    not a ``TensorBoardLogger``/``CSVLogger`` (its folder is not known before the run).

    A first logger of unset ``version`` is set to the folder found, and so is every other such logger whose root
    holds a folder of the same version (launches number their loggers' folders alike), so that the logs continue
    there."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    from lightning_bigtrain.checkpointing import latest_checkpoint

    loggers = list(trainer.loggers)
    if not loggers or not _versioned(loggers[0]):
        return False, None
    first = loggers[0]
    root = _root(first, trainer)
    fs = get_filesystem(root)
    fixed = logger_version(first)
    if fixed is not None:
        version = fixed if isinstance(fixed, str) else f"version_{fixed}"
        return True, latest_checkpoint(os.path.join(root, version, "checkpoints"), prefer_prefix="last")
    for number in _versions(fs, root):
        path = latest_checkpoint(os.path.join(root, f"version_{number}", "checkpoints"), prefer_prefix="last")
        if path is None:
            continue
        set_logger_version(first, number)
        for other in loggers[1:]:
            if _versioned(other) and logger_version(other) is None and number in _versions(fs, _root(other, trainer)):
                set_logger_version(other, number)
        return True, path
    return True, None


def _read_rows(fs: Any, path: str) -> tuple[list[str], list[dict[str, str]]]:
    with fs.open(path, "r", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _read_header(fs: Any, path: str) -> list[str]:
    with fs.open(path, "r", newline="") as f:
        return next(csv.reader(f), [])


def _write_rows(fs: Any, path: str, header: list[str], rows: list[dict[str, str]]) -> None:
    """Replace ``path`` by ``header`` and ``rows``, whole (a renamed temporary file where the filesystem renames)."""
    from lightning_bigtrain.data.streaming import _put_whole

    buffer = io.StringIO(newline="")
    writer = csv.DictWriter(buffer, fieldnames=header)
    writer.writeheader()
    writer.writerows(rows)
    _put_whole(fs, path, buffer.getvalue().encode())


def keep_csv_history(trainer: Any) -> None:
    """Before the loggers create their writers in a fit: a ``CSVLogger`` (of this rank's writer: rank 0's) whose
    folder holds a ``metrics.csv`` creates its writer without deleting it; :func:`continue_logs` decides at
    ``on_train_start``. A writer already created is left alone."""
    from lightning.pytorch.loggers import CSVLogger

    for logger in trainer.loggers:
        if not isinstance(logger, CSVLogger) or logger_writer_created(logger):
            continue
        fs = logger_filesystem(logger)
        path = os.path.join(logger.log_dir, "metrics.csv")
        if not fs.isfile(path):
            continue
        with csv_writer_keeping_files():
            writer = logger.experiment
        if not hasattr(writer, "metrics_file_path"):  # another rank's stand-in
            continue
        header, _ = _read_rows(fs, path)
        writer.metrics_keys = list(header)
        setattr(writer, _KEPT, True)


def _step_of(row: dict[str, str]) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None


def _after(row: dict[str, str], step: int) -> bool:
    logged = _step_of(row)
    return logged is not None and logged > step


def _continue_csv(logger: Any, resumed: bool, step: int) -> None:
    writer = logger.experiment
    if not getattr(writer, _KEPT, False):
        return
    delattr(writer, _KEPT)
    fs, path = logger_filesystem(logger), writer.metrics_file_path
    if not resumed:  # a fresh start in a used folder: the old history goes, as Lightning deletes it
        if fs.isfile(path):
            warn_once(
                f"CSVLogger: {path} held the log of an earlier run; this fit does not resume from a checkpoint and "
                "starts a new one (give the logger another `version` to keep both).",
                BigtrainWarning,
            )
            fs.rm_file(path)
        writer.metrics_keys = []
        return
    header, rows = _read_rows(fs, path)
    kept = [row for row in rows if not _after(row, step)]
    if len(kept) < len(rows):
        _write_rows(fs, path, header, kept)
    at_step = {_columns(row) for row in kept if _step_of(row) == step}
    if not at_step:
        return
    original = writer.log_metrics

    def log_metrics(metrics_dict: dict[str, Any], step_: int | None = None) -> None:
        # The resumed run logs again at the checkpoint's step what the interrupted run logged there after the save
        # (the validation due after the batch): that row replaces the interrupted run's with the same columns.
        if step_ == step:
            columns = frozenset([*metrics_dict, "step"])
            if columns in at_step:
                at_step.discard(columns)
                _drop_row(fs, path, step, columns)
        elif step_ is not None and step_ > step:
            writer.log_metrics = original  # past the checkpoint's step: nothing more to replace
        original(metrics_dict, step_)

    writer.log_metrics = log_metrics


def _columns(row: dict[str, str]) -> frozenset[str]:
    return frozenset(k for k, v in row.items() if v not in ("", None))


def _drop_row(fs: Any, path: str, step: int, columns: frozenset[str]) -> None:
    header, rows = _read_rows(fs, path)
    for index in range(len(rows) - 1, -1, -1):
        if _step_of(rows[index]) == step and _columns(rows[index]) == columns:
            del rows[index]
            _write_rows(fs, path, header, rows)
            return


def _continue_tensorboard(logger: Any, step: int) -> None:
    writer = logger.experiment
    get_file_writer = getattr(writer, "_get_file_writer", None)
    if get_file_writer is None:  # another rank's stand-in
        return
    if type(writer).__module__.startswith("tensorboardX"):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
    else:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
    # TensorBoard hides the events of earlier files from this step on (SummaryWriter's purge_step).
    get_file_writer().add_event(
        Event(wall_time=time.time(), step=step + 1, session_log=SessionLog(status=SessionLog.START))
    )


def continue_logs(trainer: Any) -> None:
    """At ``on_train_start`` of a fit (after the checkpoint is restored, before training), on rank 0: the logs kept
    by :func:`keep_csv_history` and the TensorBoard folder continue from the checkpoint's logging step."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    if not trainer.is_global_zero:
        return
    resumed = trainer.ckpt_path is not None
    step = logging_step(trainer)
    for logger in trainer.loggers:
        try:
            if isinstance(logger, CSVLogger):
                _continue_csv(logger, resumed, step)
            elif isinstance(logger, TensorBoardLogger) and resumed:
                _continue_tensorboard(logger, step)
        except OSError as error:  # the logs are not worth the run
            warn_once(
                f"{type(logger).__name__} in {logger.log_dir}: its log could not be continued from the "
                f"checkpoint's step {step} ({error}); rows or events logged after the checkpoint may repeat.",
                BigtrainWarning,
            )
