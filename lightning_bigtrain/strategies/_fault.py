"""What this package's strategies share for crash consistency: preemption signals (record, agree at the next
batch, checkpoint, exit with :data:`EXIT_PREEMPTED`), resumable training dataloaders, atomic single-file
checkpoints. :class:`~lightning_bigtrain.callbacks.FaultTolerance` gives Lightning's own strategies the same."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any, cast

import lightning as L
import torch
import torch.distributed as dist
from typing_extensions import override

from lightning_bigtrain._compat import (
    StrategyMixinBase,
    restore_callback_metrics,
    run_pending_batch_end,
    saved_callback_metrics,
    should_accumulate,
    update_plateau_schedulers_at_restored_epoch_end,
)
from lightning_bigtrain._resume_logs import continue_logs, keep_csv_history
from lightning_bigtrain.checkpointing import AtomicCheckpointIO
from lightning_bigtrain.data.resumable import load_pending_states, make_resumable
from lightning_bigtrain.strategies._epoch_state import EPOCH_STATE_KEY, epoch_state_for_checkpoint, restore_epoch_state

__all__ = ["EXIT_PREEMPTED", "FaultTolerantStrategyMixin", "Preempted", "Preemption"]

EXIT_PREEMPTED = 75
METRICS_KEY = "bigtrain_callback_metrics"  # the scalar callback metrics at the save (Lightning saves none)
_SIGNALS = ("SIGTERM", "SIGUSR1")


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is committed; exits with :data:`EXIT_PREEMPTED`."""

    def __init__(self, path: str) -> None:
        super().__init__(EXIT_PREEMPTED)
        self.path = path

    def __str__(self) -> str:
        return f"preempted: checkpoint committed at {self.path}; relaunch with ckpt_path='last' to continue"


_EXIT_HOOK = [False]


_EXIT_GRACE_S = 0.1


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits (an ``atexit`` hook, while Python is still whole),
    where the run has not, then hand the GIL to gloo's worker threads for a moment. A process that exits with its gloo
    group alive can abort in interpreter finalization (gloo's worker threads still hold finished work whose tensors
    reference Python objects; pytorch#190489): a job whose training finished then dies with SIGABRT ("terminate called
    without an active exception"), its scheduler sees a failure and relaunches it. Destroying the group is not enough
    (2 of about 100 finished 2-rank jobs still aborted, the group destroyed): a worker releases a finished
    collective's tensors after the caller has woken from its wait, and one still doing so once the interpreter
    finalizes cannot take the GIL; its thread exits through C++ frames that may not unwind (a core dump: the worker in
    ``take_gil`` under ``~AsyncAllreduceWork`` while the main thread collected garbage in ``Py_FinalizeEx``).
    Registered once per process."""
    if _EXIT_HOOK[0]:
        return
    _EXIT_HOOK[0] = True

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):  # exiting: nothing to report it to
                dist.destroy_process_group()
        time.sleep(_EXIT_GRACE_S)  # releases the GIL: workers finish releasing their last work before finalization

    atexit.register(destroy)


def _check_signals(signals: Sequence[str], owner: str) -> tuple[str, ...]:
    names = tuple(signals)
    for name in names:
        if not isinstance(name, str) or not hasattr(signal, name) or not name.startswith("SIG"):
            raise ValueError(f"`{owner}(signals={names!r})`: {name!r} is not a signal name such as 'SIGTERM'.")
        if name in ("SIGKILL", "SIGSTOP"):
            raise ValueError(f"`{owner}(signals={names!r})`: {name} cannot be caught; a process just dies.")
    return names


class Preemption:
    """Signal handling shared by the strategies and the callback: record a signal, agree on it at the next
    batch, checkpoint, exit."""

    def __init__(self, signals: Sequence[str] = _SIGNALS) -> None:
        self.signals = _check_signals(signals, "FaultTolerance")
        self.received: str | None = None
        self.active = False  # the same on every rank: it decides whether the check's collective runs
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = signal.Signals(signum).name

    def install(self) -> None:
        """Replace the handlers (Lightning's own SIGTERM handler included) for the duration of training. Every
        rank calls it; outside the main thread no handler can be set, but the rank still takes part in the
        check, so a signal another rank received still stops it."""
        if self.active:
            return
        self.active = True
        self.received = None
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.signals:
            num = getattr(signal, name)
            self._previous[num] = signal.getsignal(num)
            signal.signal(num, self._handler)

    def uninstall(self) -> None:
        self.active = False
        for num, handler in self._previous.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(num, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def _agreed(self, trainer: L.Trainer) -> bool:
        flag = 1 if self.received else 0
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            t = torch.tensor([flag], dtype=torch.int32, device=trainer.strategy.root_device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = int(t.item())
        return flag > 0

    def check(self, trainer: L.Trainer) -> None:
        """At the end of a training batch: if any rank was signalled, checkpoint and raise :class:`Preempted`.
        Collective when more than one rank runs. Mid-accumulation it waits for the batch that steps (the
        gradients of an unfinished cycle are in no checkpoint)."""
        if not self.active:
            return
        if not self._agreed(trainer):
            return
        if should_accumulate(trainer):
            return
        path = _last_path(trainer)
        # Saved where ModelCheckpoint saves (after the batch's optimizer step): Lightning's restore and every
        # stateful loader's own count of yielded batches read it as it reads those.
        trainer.save_checkpoint(path)
        for cb in trainer.checkpoint_callbacks:
            if hasattr(cb, "last_model_path"):
                cb.last_model_path = path
        raise Preempted(path)


def repair_epoch_progress(trainer: L.Trainer) -> None:
    """Mark the epoch being trained as started when Lightning did not (call at every training batch start).

    Lightning 2.6 resuming from a checkpoint saved after the last batch of an epoch continues into the next
    epoch without counting it as started; every checkpoint of that epoch then says it never began, and a resume
    from one replays the epoch from its first batch (seen with plain Lightning: 11 steps instead of 9). In an
    uninterrupted run an epoch in progress always has ``ready == completed + 1``.
    """
    progress = trainer.fit_loop.epoch_progress
    if progress.current.ready == progress.current.completed:
        progress.increment_ready()
        progress.increment_started()


class _PreemptionHook(L.Callback):
    """Put into ``trainer.callbacks`` by this package's strategies for the fit (strategies have no batch-end
    hook): the preemption check, the epoch-progress repair, the plateau schedulers at a restored epoch's end, the
    callback metrics, metric states and the epoch's logged aggregates into checkpoints."""

    def __init__(self, preemption: Preemption) -> None:
        self.preemption = preemption

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        save_progress_state(trainer, checkpoint)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        repair_epoch_progress(trainer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.preemption.check(trainer)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        update_plateau_schedulers_at_restored_epoch_end(trainer)


def save_progress_state(trainer: L.Trainer, checkpoint: dict[str, Any]) -> None:
    """What Lightning leaves out of a checkpoint and a resume needs (from ``on_save_checkpoint``, on every rank): the
    scalar callback metrics, every rank's metric states and, inside an epoch, its logged epoch aggregates."""
    checkpoint[METRICS_KEY] = saved_callback_metrics(trainer)
    state = epoch_state_for_checkpoint(trainer)
    if state is not None:
        checkpoint[EPOCH_STATE_KEY] = state


def take_progress_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """:func:`save_progress_state`'s entries, taken out of a loaded checkpoint (kept until :func:`resume_fit`)."""
    return {key: checkpoint.pop(key) for key in (METRICS_KEY, EPOCH_STATE_KEY) if key in checkpoint}


def resume_fit(trainer: L.Trainer, progress: dict[str, Any] | None, data: bool = True) -> None:
    """At ``on_train_start``, what a resumed fit does before training, in order: the logs continued from the
    checkpoint's step (:func:`~lightning_bigtrain._resume_logs.continue_logs`), the dataloaders' saved positions
    (with ``data``), the work due after the checkpoint (:func:`run_pending_batch_end`), the saved callback metrics
    and epoch state (``progress``: :func:`take_progress_state`'s)."""
    progress = progress or {}
    continue_logs(trainer)
    if data:
        load_pending_states(trainer)
    run_pending_batch_end(trainer)
    restore_callback_metrics(trainer, progress.get(METRICS_KEY) or {})
    restore_epoch_state(trainer, progress.get(EPOCH_STATE_KEY))


def _last_path(trainer: L.Trainer) -> str:
    """Where ``ckpt_path="last"`` will look: ``last.ckpt`` in the ModelCheckpoint folder."""
    cb = trainer.checkpoint_callback
    dirpath = getattr(cb, "dirpath", None)
    if dirpath is None:
        dirpath = os.path.join(trainer.default_root_dir, "checkpoints")
    name = getattr(cb, "CHECKPOINT_NAME_LAST", "last") + getattr(cb, "FILE_EXTENSION", ".ckpt")
    return f"{str(dirpath).rstrip('/')}/{name}"


class FaultTolerantStrategyMixin(StrategyMixinBase):
    """Mixed into this package's strategies: resumable training dataloaders, atomic single-file checkpoints,
    preemption signals. Folder checkpoints are committed by each strategy's ``save_checkpoint``."""

    _preemption: Preemption | None = None
    _saved_progress: dict[str, Any] | None = None

    def _init_fault_tolerance(self) -> None:
        if getattr(self, "_checkpoint_io", None) is None:
            cast(Any, self).checkpoint_io = AtomicCheckpointIO()  # the Strategy's property setter
        self._preemption = Preemption()

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._keep_log_history()

    def _keep_log_history(self) -> None:
        """Before the loggers create their writers: a fit's CSV log in a used folder stays until ``on_train_start``
        decides what of it a resume keeps (:mod:`lightning_bigtrain._resume_logs`)."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is not None and trainer.state.fn == "fit":
            keep_csv_history(trainer)

    def _keep_progress_state(self, checkpoint: dict[str, Any]) -> None:
        """Called by each strategy's ``load_checkpoint``: the callback metrics and the epoch state the checkpoint
        holds, restored at ``on_train_start``."""
        self._saved_progress = take_progress_state(checkpoint)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Validation loaders built during fit get the resumable sampler too: without a resume position it
        # draws DistributedSampler's order, and Lightning saves and restores the training loader's state only.
        dataloader = super().process_dataloader(dataloader)
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        if trainer is None or not trainer.training:
            return dataloader
        return make_resumable(dataloader, lambda: getattr(self.lightning_module, "_trainer", None))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None
        trainer: Any = self.lightning_module.trainer
        resume_fit(trainer, self._saved_progress)
        self._saved_progress = None
        destroy_process_group_at_exit()
        if self._preemption is not None:
            self._preemption.install()
            if not any(isinstance(cb, _PreemptionHook) for cb in trainer.callbacks):
                trainer.callbacks.append(_PreemptionHook(self._preemption))

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        self._saved_progress = None  # loaded by a run that did not train (validate)
        if self._preemption is not None:
            self._preemption.uninstall()
            module = self.lightning_module
            trainer = getattr(module, "_trainer", None) if module is not None else None
            if trainer is not None:
                trainer.callbacks[:] = [cb for cb in trainer.callbacks if not isinstance(cb, _PreemptionHook)]
        super().teardown()
