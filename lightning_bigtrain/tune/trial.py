"""TuneTrial: the callback that ties one ``bigtrain fit`` run to its Optuna trial.

Every ``report_every`` optimizer steps all ranks average the monitored value (``trainer.strategy.reduce``), rank
0 reports it to the trial and asks the study's pruner, and the decision is broadcast from rank 0
(``trainer.strategy.broadcast``): every rank stops at the same step, whatever the strategy, with no database
and no ``check_pruned()`` for the user to call. At the end rank 0 writes the run's measures (the objectives) to
``result_path`` as JSON for the ``bigtrain tune`` driver, which tells the study.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_bigtrain.callbacks.report import _first_tensor
from lightning_bigtrain.functional.memory import peak_memory_bytes

__all__ = ["MEASURES", "TuneTrial", "make_pruner", "open_storage"]

#: Objectives measured by the callback itself (anything else names a metric the module logs in validation).
MEASURES = {
    "step_time": "seconds per optimizer step (slowest rank; start-up and validation left out)",
    "peak_memory": "peak memory of the busiest rank, bytes (CUDA allocator peak on GPUs, peak RSS on CPU)",
    "bytes_sent": "bytes each rank sent per optimizer step (the strategy's own count; DDP's ring all-reduce)",
}

_PRUNERS = ("median", "percentile", "hyperband", "successive_halving", "threshold", "patient", "none")


def make_pruner(spec: str | dict[str, Any] | None) -> Any:
    """An Optuna pruner from ``"median"`` or ``{"name": "median", "n_startup_trials": 4, ...}`` (keywords go to
    the Optuna class); ``None`` / ``"none"``: no pruning."""
    import optuna

    if spec is None:
        return optuna.pruners.NopPruner()
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or "name" not in spec:
        raise ValueError(f"`pruning.pruner={spec!r}`: give a name ({', '.join(_PRUNERS)}) or {{name: ..., ...}}.")
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    name = spec["name"]
    classes = {
        "median": optuna.pruners.MedianPruner,
        "percentile": optuna.pruners.PercentilePruner,
        "hyperband": optuna.pruners.HyperbandPruner,
        "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
        "threshold": optuna.pruners.ThresholdPruner,
        "none": optuna.pruners.NopPruner,
    }
    if name == "patient":
        inner = make_pruner(kwargs.pop("wrapped", "median"))
        return optuna.pruners.PatientPruner(inner, **kwargs)
    if name not in classes:
        raise ValueError(f"`pruning.pruner: {name!r}` is not a pruner; choose one of {', '.join(_PRUNERS)}.")
    try:
        return classes[name](**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"`pruning.pruner: {spec}`: {err}") from None


def open_storage(storage: str) -> Any:
    """An Optuna storage: an URL with ``://`` (``sqlite:///study.db``, ``postgresql://...``) as Optuna reads it,
    else the path of a journal file (append-only, shared by workers through a file lock; no server needed)."""
    import optuna

    if "://" in storage:
        return optuna.storages.RDBStorage(storage)
    from optuna.storages.journal import JournalFileBackend

    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(storage))


class TuneTrial(Callback):
    """The trial's side of ``bigtrain tune``: step-level pruning that stops all ranks together, and the measures.

    The driver adds it to each trial's config; it can also connect a hand-launched run to a trial.

    Args:
        result_path: Where rank 0 writes the outcome as JSON (``status``: ``"complete"`` or ``"pruned"``, the
            step it stopped at on every rank, the ``measures``).
        objectives: What to measure: names in :data:`MEASURES`, or metrics logged in validation (their value at
            the last validation).
        storage: The study's storage (see :func:`open_storage`); needed only when pruning.
        study_name: The study's name; needed only when pruning.
        trial_id: The Optuna trial id (``trial._trial_id``); needed only when pruning.
        pruner: The study's pruner spec (:func:`make_pruner`); ``None`` turns pruning off.
        report_every: Optimizer steps (``report_unit="steps"``) or training samples over all ranks
            (``"samples"``) between reports to the pruner.
        report_unit: ``"steps"``, or ``"samples"``: the trial reports at multiples of ``report_every`` samples
            seen, so that trials with different batch sizes are compared by the pruner at the same amount of data
            (Optuna's pruners compare trials at equal report steps). Samples per step are the global batch: rank
            0's first batch x ranks x ``accumulate_grad_batches``.
        monitor: What is reported: ``"train_loss"`` (the mean training loss since the last report, averaged over
            ranks; negated when the study maximizes, so that the pruner ranks it the right way), or a metric the
            module logs (its latest value, averaged over ranks), taken to improve in the study's direction.
        warmup_steps: Optimizer steps left out of ``step_time`` (start-up, first calls, compilation).
    """

    def __init__(
        self,
        result_path: str,
        objectives: list[str] | None = None,
        storage: str | None = None,
        study_name: str | None = None,
        trial_id: int | None = None,
        pruner: str | dict[str, Any] | None = None,
        report_every: int = 50,
        report_unit: str = "steps",
        monitor: str = "train_loss",
        warmup_steps: int = 2,
    ) -> None:
        if isinstance(report_every, bool) or not isinstance(report_every, int) or report_every < 1:
            raise ValueError(f"`TuneTrial(report_every={report_every!r})`: an int >= 1 ({report_unit}).")
        if report_unit not in ("steps", "samples"):
            raise ValueError(f"`TuneTrial(report_unit={report_unit!r})`: choose 'steps' or 'samples'.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"`TuneTrial(warmup_steps={warmup_steps!r})`: optimizer steps, an int >= 0.")
        self.pruning = pruner is not None and pruner != "none"
        if self.pruning and (storage is None or study_name is None or trial_id is None):
            raise ValueError(
                "`TuneTrial(pruner=...)`: pruning needs the study's `storage`, `study_name` and `trial_id`."
            )
        self.result_path = result_path
        self.objectives = list(objectives or ["val_loss"])
        self.storage = storage
        self.study_name = study_name
        self.trial_id = trial_id
        self.pruner_spec = pruner
        self.report_every = report_every
        self.report_unit = report_unit
        self.monitor = monitor
        self._sign = 1.0
        self._samples_per_step: int | None = None
        self.warmup_steps = warmup_steps
        self._trial: Any = None
        self.pruned_at: int | None = None
        self._restored: dict[str, Any] | None = None
        self._trainer: L.Trainer | None = None
        self._reset()

    def _reset(self) -> None:
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._last_report = self._start_step = 0
        self._t0: float | None = None
        self._step0 = 0
        self._val_seconds = 0.0
        self._val_started: float | None = None
        self._validated: dict[str, tuple[float, int]] = {}
        self._bytes0: float | None = None  # the strategy's byte count when this launch started training

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage != "fit" or not self.pruning or not trainer.is_global_zero:
            return
        import optuna

        study = optuna.load_study(
            study_name=self.study_name, storage=open_storage(str(self.storage)), pruner=make_pruner(self.pruner_spec)
        )
        if len(study.directions) > 1:
            raise ValueError(
                "`TuneTrial(pruner=...)`: Optuna's pruners take one objective; this study has "
                f"{len(study.directions)}. Give `pruner=None` for a multi-objective study."
            )
        self._trial = optuna.Trial(study, int(self.trial_id))  # type: ignore[arg-type]
        maximize = study.direction == optuna.study.StudyDirection.MAXIMIZE
        self._sign = -1.0 if maximize and self.monitor == "train_loss" else 1.0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        self._last_report = self._start_step = trainer.global_step  # a resumed run reports from where it is
        if self._restored is not None:  # the report window and validated metrics carried over a resume
            state, self._restored = self._restored, None
            sums, counts = list(state.get("loss_sum", [])), list(state.get("loss_count", []))
            rank = trainer.global_rank
            if len(sums) == trainer.world_size:  # each rank its own window
                loss, count = sums[rank], counts[rank]
            else:  # another world size: every rank the ranks' mean window
                loss, count = sum(sums) / max(len(sums), 1), round(sum(counts) / max(len(counts), 1))
            if count:
                self._loss_sum, self._loss_count = torch.tensor(float(loss), device=pl_module.device), int(count)
            self._validated = {k: (float(v), int(s)) for k, (v, s) in state.get("validated", {}).items()}
        counted = getattr(trainer.strategy, "comm_bytes", None)
        self._bytes0 = None if counted is None else float(counted)
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float()
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1
        step = trainer.global_step
        if self._t0 is None and step - self._start_step >= self.warmup_steps:
            if pl_module.device.type == "cuda":
                torch.cuda.synchronize(pl_module.device)
            self._t0, self._step0 = time.perf_counter(), step
        if not self.pruning:
            return
        if self.report_unit == "steps":
            if step > self._last_report and step % self.report_every == 0:
                self._last_report = step
                self._report(trainer, pl_module, step)
            return
        if self._samples_per_step is None:
            local = _first_tensor(batch)
            rows = int(local.shape[0]) if local is not None and local.ndim > 0 else 0
            rows = int(trainer.strategy.broadcast(rows, src=0))  # one number for every rank: same report steps
            if rows < 1:
                raise ValueError("`TuneTrial(report_unit='samples')`: the batch holds no tensor to count samples in.")
            self._samples_per_step = rows * trainer.world_size * trainer.accumulate_grad_batches
        bucket = step * self._samples_per_step // self.report_every
        if step > self._last_report and bucket > self._last_report * self._samples_per_step // self.report_every:
            self._last_report = step
            self._report(trainer, pl_module, bucket * self.report_every)

    def _report(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int) -> None:
        if self.monitor == "train_loss":
            if self._loss_sum is None or self._loss_count == 0:
                raise ValueError(
                    "`TuneTrial(monitor='train_loss')`: `training_step` returned no loss tensor to report; "
                    "log a metric and give its name as `monitor`."
                )
            local = self._loss_sum / self._loss_count
        else:
            value = trainer.callback_metrics.get(self.monitor)
            if value is None:
                logged = ", ".join(sorted(trainer.callback_metrics)) or "none yet"
                raise ValueError(
                    f"`TuneTrial(monitor={self.monitor!r})`: no such metric was logged by step {step} "
                    f"(logged: {logged}). Use 'train_loss' or a metric `training_step` logs every step."
                )
            local = torch.as_tensor(value, dtype=torch.float32)
        local = local.to(pl_module.device, torch.float32)
        mean = float(trainer.strategy.reduce(local.clone(), reduce_op="mean"))
        self._loss_sum, self._loss_count = None, 0
        prune = False
        if trainer.is_global_zero:
            assert self._trial is not None
            self._trial.report(self._sign * mean if math.isfinite(mean) else float("nan"), step)
            prune = bool(self._trial.should_prune()) or not math.isfinite(mean)
        prune = bool(trainer.strategy.broadcast(prune, src=0))
        if prune:
            self.pruned_at = trainer.global_step  # the optimizer step (``step`` is the report's, maybe samples)
            trainer.should_stop = True

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._val_started = time.perf_counter()

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._val_started is not None and self._t0 is not None:
            self._val_seconds += time.perf_counter() - self._val_started
        self._val_started = None
        if trainer.sanity_checking:
            return
        for name in self.objectives:
            if name in MEASURES:
                continue
            value = trainer.callback_metrics.get(name)
            if value is not None:
                self._validated[name] = (float(value), trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The open report window (every rank's training losses summed since the last report: gathered, a collective
        as the checkpoint itself is) and the metrics validated so far, so that a resumed trial reports what the
        uninterrupted one would."""
        trainer = self._trainer
        local = torch.tensor([0.0 if self._loss_sum is None else float(self._loss_sum), float(self._loss_count)],
                             dtype=torch.float64)  # fmt: skip
        if trainer is not None and trainer.world_size > 1:
            gathered = trainer.strategy.all_gather(local.to(trainer.strategy.root_device)).reshape(-1, 2).cpu()
        else:
            gathered = local.reshape(1, 2)
        return {"loss_sum": gathered[:, 0].tolist(), "loss_count": [int(c) for c in gathered[:, 1].tolist()],
                "validated": dict(self._validated)}  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = dict(state_dict)  # applied at train start (after the per-launch reset)

    def _bytes_per_step(self, trainer: L.Trainer, steps: int) -> float | None:
        strategy = trainer.strategy
        counted = getattr(strategy, "comm_bytes", None)
        if counted is not None:
            # Over this launch's steps: a resumed strategy counts from its setup (some counters are restored).
            start = self._bytes0 if self._bytes0 is not None else 0.0
            return (float(counted) - start) / max(steps - self._start_step, 1)
        world = trainer.world_size
        if world == 1:
            return 0.0
        from lightning.pytorch.strategies import DDPStrategy

        if type(strategy) is DDPStrategy:  # a ring all-reduce of every gradient: 2(N-1)/N of their bytes
            grads = sum(p.numel() * p.element_size() for p in trainer.lightning_module.parameters() if p.requires_grad)
            return 2.0 * (world - 1) / world * grads
        return None

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = pl_module.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps = trainer.global_step
        if self._t0 is not None and steps > self._step0:
            step_time = (time.perf_counter() - self._t0 - self._val_seconds) / (steps - self._step0)
        else:
            step_time = float("nan")
        sent = self._bytes_per_step(trainer, steps)
        stopped = float(steps)
        local = torch.tensor(
            [step_time, float(peak_memory_bytes(device)), float("nan") if sent is None else sent, stopped],
            dtype=torch.float64,
            device=device,
        )
        gathered = trainer.strategy.all_gather(local)
        gathered = gathered.reshape(-1, 4).cpu() if gathered.ndim > 1 else gathered.reshape(1, 4).cpu()
        if not trainer.is_global_zero:
            return
        measures: dict[str, float | None] = {
            "step_time": float(gathered[:, 0].max()),
            "peak_memory": float(gathered[:, 1].max()),
            "bytes_sent": None if math.isnan(float(gathered[:, 2].mean())) else float(gathered[:, 2].mean()),
        }
        validated: dict[str, Any] = {}
        for name in self.objectives:
            if name not in MEASURES:
                value, at = self._validated.get(name, (None, None))
                measures[name] = value
                validated[name] = at
        result = {
            "status": "pruned" if self.pruned_at is not None else "complete",
            "pruned_at_step": self.pruned_at,
            "steps": steps,
            "stopped_at_step_per_rank": [int(v) for v in gathered[:, 3]],
            "world_size": trainer.world_size,
            "strategy": type(trainer.strategy).__name__,
            "measures": measures,
            "validated_at_step": validated,
        }
        path = Path(self.result_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
