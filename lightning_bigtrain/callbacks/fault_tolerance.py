"""Crash consistency for long runs: atomic checkpoints, exact mid-epoch resume, preemption signals.

Under this package's strategies (``ZeroStrategy``, ``DeepSpeedZeroStrategy``, ``CompressedDDPStrategy``) all of
it is on by default, with Lightning's own ``ModelCheckpoint``. For Lightning's strategies (``"ddp"``,
``"fsdp"``, ``"deepspeed"``, ...) the :class:`FaultTolerance` callback gives the same guarantees.

Preemption: schedulers send ``SIGTERM`` (or ``SIGUSR1``, e.g. SLURM's ``--signal=USR1@90``) some time before
they kill a job. The handler only records the signal; at the end of the next training batch every rank
learns of it (a one-element all-reduce per batch), the run writes a checkpoint after the optimizer step
that just finished (at a gradient-accumulation boundary), and every rank exits with status
:data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``: "try again"), on which a job script requeues. The relaunch,
with ``ckpt_path="last"`` (``bigtrain fit --resume auto``), continues exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from typing_extensions import override

from lightning_bigtrain._compat import update_plateau_schedulers_at_restored_epoch_end
from lightning_bigtrain.checkpointing import AtomicCheckpointIO, atomic_folder_save, load_path
from lightning_bigtrain.data.resumable import make_resumable
from lightning_bigtrain.strategies._fault import (
    _SIGNALS,
    EXIT_PREEMPTED,
    FaultTolerantStrategyMixin,
    Preempted,
    Preemption,
    _check_signals,
    destroy_process_group_at_exit,
    repair_epoch_progress,
    resume_fit,
    save_progress_state,
    take_progress_state,
)
from lightning_bigtrain.warnings import NoEffectWarning, warn_once

__all__ = ["EXIT_PREEMPTED", "FaultTolerance", "Preempted"]


def _writes_folders(strategy: Any) -> bool:
    """Whether ``strategy`` saves a checkpoint as a folder of shards (not through its CheckpointIO)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    if isinstance(strategy, DeepSpeedStrategy):
        return True
    if isinstance(strategy, FSDPStrategy):
        return getattr(strategy, "_state_dict_type", "full") == "sharded"
    if isinstance(strategy, ModelParallelStrategy):
        return bool(getattr(strategy, "_save_distributed_checkpoint", True))
    return False


class FaultTolerance(L.Callback):
    """Crash-consistent training under Lightning's own strategies (``"ddp"``, ``"fsdp"``, ``"deepspeed"``, ...).

    * **Atomic checkpoints**: single files through :class:`~lightning_bigtrain.checkpointing.AtomicCheckpointIO`
      (installed as the strategy's ``checkpoint_io``); folders (FSDP sharded, DeepSpeed, distributed
      checkpoints) written under a temporary name and committed last, ``<path>`` replaced by a link.
    * **Exact mid-epoch resume** of the dataloaders Lightning builds: the injected ``DistributedSampler``
      becomes a :class:`~lightning_bigtrain.data.ResumableDistributedSampler` whose global cursor is saved in
      checkpoints (re-partitioned at another world size). A stateful dataloader of the user's own (torchdata's
      ``StatefulDataLoader``) is left to its own ``state_dict``.
    * **Preemption**: ``SIGTERM``/``SIGUSR1`` write ``last.ckpt`` in the ModelCheckpoint folder after the
      current optimizer step and exit with status :data:`EXIT_PREEMPTED` (75).

    Under this package's strategies all three are on already; the callback then only warns that it is not
    needed. Acts in: ``setup`` (checkpoint IO, dataloader hook, folder saves), ``on_train_start`` (signal
    handlers), ``on_train_batch_start`` (step-seeded RNG), ``on_train_batch_end`` (signal check: all ranks agree,
    checkpoint, exit), ``teardown`` (everything put back). Exactness also
    needs deterministic randomness: seed the run (``seed_everything``); dropout is resumed exactly by this
    package's strategies' step-seeded generators, under Lightning's strategies only when the model draws
    no random numbers, or with ``step_seeded_rng=True`` here.

    Args:
        atomic: Write checkpoints atomically.
        resumable_data: Make the training dataloaders Lightning builds resume mid-epoch.
        signals: Signal names that trigger a checkpoint and exit (empty: none).
        step_seeded_rng: Re-seed every generator from the run's seed and the batch index at each batch
            (dropout and other random draws resume exactly).
    """

    def __init__(
        self,
        *,
        atomic: bool = True,
        resumable_data: bool = True,
        signals: Sequence[str] = _SIGNALS,
        step_seeded_rng: bool = False,
    ) -> None:
        if isinstance(signals, str):
            raise ValueError(f"`FaultTolerance(signals={signals!r})`: pass a list of names, e.g. ['SIGTERM'].")
        self.atomic = bool(atomic)
        self.resumable_data = bool(resumable_data)
        self.signals = _check_signals(signals, "FaultTolerance")
        self.step_seeded_rng = bool(step_seeded_rng)
        self._preemption = Preemption(self.signals) if self.signals else None
        self._restore: list[tuple[Any, str, Any]] = []
        self._active = False
        self._rng_seed: int | None = None
        self._saved_progress: dict[str, Any] | None = None

    @property
    def state_key(self) -> str:
        return "FaultTolerance"

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, FaultTolerantStrategyMixin):
            warn_once(
                f"`FaultTolerance()` has no effect with {type(strategy).__name__}: the strategy checkpoints "
                "atomically, resumes dataloaders mid-epoch and handles preemption signals already.",
                NoEffectWarning,
            )
            return
        self._active = True
        self._rng_seed = torch.initial_seed()
        if self.atomic:
            self._install_atomic(strategy)
        if self.resumable_data:
            original = strategy.process_dataloader

            def process_dataloader(dataloader: object) -> object:
                dataloader = original(dataloader)
                if not trainer.training:
                    return dataloader
                return make_resumable(dataloader, lambda: trainer)

            self._patch(strategy, "process_dataloader", process_dataloader)

    def _install_atomic(self, strategy: Any) -> None:
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        io = strategy.checkpoint_io
        if type(io) is TorchCheckpointIO:
            self._patch(strategy, "checkpoint_io", AtomicCheckpointIO())
        elif not isinstance(io, AtomicCheckpointIO):
            warn_once(
                f"`FaultTolerance(atomic=True)` keeps the strategy's own {type(io).__name__}: single-file "
                "checkpoints are written as it writes them, not atomically.",
                NoEffectWarning,
            )
        if _writes_folders(strategy):
            save, load = strategy.save_checkpoint, strategy.load_checkpoint

            def save_checkpoint(checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
                atomic_folder_save(strategy, filepath, lambda staging: save(checkpoint, staging, storage_options))

            def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
                location = strategy.broadcast(load_path(str(checkpoint_path)) if strategy.is_global_zero else None)
                return load(location, *args, **kwargs)

            self._patch(strategy, "save_checkpoint", save_checkpoint)
            self._patch(strategy, "load_checkpoint", load_checkpoint)

    def _patch(self, obj: Any, name: str, value: Any) -> None:
        if name == "checkpoint_io":
            self._restore.append((obj, name, obj.checkpoint_io))
            obj.checkpoint_io = value
            return
        self._restore.append((obj, name, obj.__dict__.get(name)))
        setattr(obj, name, value)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._active:
            destroy_process_group_at_exit()
            resume_fit(trainer, self._saved_progress, data=self.resumable_data)
        self._saved_progress = None
        if self._active and self._preemption is not None:
            self._preemption.install()

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._active:
            repair_epoch_progress(trainer)
        if self._active and self.step_seeded_rng and self._rng_seed is not None:
            from lightning_bigtrain.functional.rng import fold_seed, seed_all_

            seed_all_(fold_seed(self._rng_seed, trainer.fit_loop.epoch_loop.total_batch_idx))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._active and self._preemption is not None:
            self._preemption.check(trainer)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._active:
            update_plateau_schedulers_at_restored_epoch_end(trainer)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        if self._active:
            save_progress_state(trainer, checkpoint)

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._saved_progress = take_progress_state(checkpoint)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"rng_seed": self._rng_seed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("rng_seed") is not None:
            self._rng_seed = int(state_dict["rng_seed"])

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._preemption is not None:
            self._preemption.uninstall()
        for obj, name, value in reversed(self._restore):
            if name == "checkpoint_io":
                obj.checkpoint_io = value
            elif value is None:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, value)
        self._restore = []
        self._active = False
        self._saved_progress = None  # loaded by a run that did not train (validate)
