"""Tuner: the ``bigtrain tune`` driver. Each trial is a real ``bigtrain fit`` run in its own process group.

A trial runs as ``python -m lightning_bigtrain.cli fit --config <trial>/config.yaml --resume auto``: the base
config with the trial's sampled values written in, its logger, checkpoints and report moved into the trial's
folder, and :class:`~lightning_bigtrain.tune.TuneTrial` added. A process per trial is what lets a trial use
every rank (Lightning's DDP launcher re-runs the command), and what keeps a crashed or out-of-memory trial from
taking the study with it.

Before launch each configuration goes through :func:`lightning_bigtrain.planning.plan`; one predicted not to fit
``device_memory`` is told to the study as a trial that never ran (state PRUNED, ``bigtrain:status=infeasible``,
the reason and the predicted bytes in its user attributes, and an Optuna constraint > 0 so that samplers steer
away from it). A driver holds an ``flock`` on each trial folder while it runs it: a RUNNING trial whose lock is
free belongs to a driver that died, and the next driver adopts it (kills what is left of its process group and
relaunches it with ``--resume auto``, so it continues from its last checkpoint). Several drivers sharing one
storage therefore share the work, and a killed study continues where it stopped.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import fcntl
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from lightning_bigtrain.tune.ray_backend import parse_backend
from lightning_bigtrain.tune.space import SearchSpace
from lightning_bigtrain.tune.trial import MEASURES, make_pruner, open_storage
from lightning_bigtrain.warnings import BigtrainWarning

__all__ = ["TrialsFailingError", "Tuner", "TunerConfigError"]

_DIRECTIONS = ("minimize", "maximize")
_SAMPLERS = ("auto", "tpe", "nsga2", "random")
_ATTR = "bigtrain:"
_STATES_DONE = ("COMPLETE", "PRUNED", "FAIL")
#: Written into a trial's folder by a driver that stops the trial's fit on its way out (a Ray driver: the fit's
#: launcher is another process), so that the launcher leaves the trial RUNNING for the next driver to adopt.
_STOPPING = "stopping"


class TunerConfigError(ValueError):
    """A ``bigtrain tune`` setting is wrong; the message names it and the fix."""


class TrialsFailingError(RuntimeError):
    """Several trials in a row failed: the driver stops rather than spend the study on the same failure."""


def _load_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise TunerConfigError(f"`{path}` does not exist.") from None
    if not isinstance(data, dict):
        raise TunerConfigError(f"`{path}` must hold a mapping.")
    return data


def _is_class(node: Any, name: str) -> bool:
    return isinstance(node, dict) and str(node.get("class_path", "")).rsplit(".", 1)[-1] == name


class Tuner:
    """A study over a ``bigtrain fit`` config: sample, plan, launch, prune, tell; then the table and the front.

    Args:
        base: The ``bigtrain fit`` config every trial starts from (a path or a mapping).
        space: ``{config path: parameter spec}`` (:mod:`lightning_bigtrain.tune.space`).
        objectives: ``{name: "minimize" | "maximize"}``: a metric the module logs in validation (``val_loss``),
            or one of ``step_time``, ``peak_memory``, ``bytes_sent``. Two or more make a multi-objective study.
        trials: Trials in the study, counted over every worker sharing its storage.
        output: Folder of the study: one folder per trial, the table, the Pareto plot, the best configs.
        study_name: The Optuna study's name (default: the output folder's name).
        storage: An Optuna URL, or a journal file path (default ``<output>/study.journal``).
        sampler: ``"auto"`` (TPE for one objective, NSGA-II for several), ``"tpe"``, ``"nsga2"``, ``"random"``.
        seed: The sampler's seed.
        pruner: Step-level pruning (:func:`~lightning_bigtrain.tune.make_pruner`): ``"median"``, a mapping with
            the pruner's keywords, or ``None``. Single-objective studies only.
        report_every: Optimizer steps, or samples (``report_unit="samples"``), between reports to the pruner.
        report_unit: ``"steps"`` or ``"samples"`` (trials of different batch sizes compared at equal data seen).
        monitor: What is reported (``"train_loss"`` or a metric the module logs every step).
        device_memory: Memory per device the planner checks each configuration against (``"8GB"``); ``None``
            launches every configuration unplanned.
        sample_shape: One sample's input shape for the planner's activation count when the data config has no
            ``block_size`` (e.g. ``[1, 28, 28]``); the batch size is read from ``data.init_args.batch_size``.
        optimizer: The optimizer the planner counts states for (``"adamw"``, ``"sgd"``, ...).
        overrides: ``{config path: value}`` written into every trial (a shorter budget, say).
        trial_timeout: Seconds before a trial is stopped and failed; ``None``: no limit.
        checkpoint_every_n_steps: How often each trial checkpoints (for resumption); ``None``: each epoch's end.
        max_failures_in_a_row: Stop the driver (:class:`TrialsFailingError`, naming the last trial's log) when this
            many of its launched trials fail one after another: a broken base config or missing data fails every
            trial the same way. ``None``: never stop.
        backend: Where the trials run: ``"local"`` (one at a time, in this driver's process group; more drivers on
            one storage run more at once) or ``"ray"`` / ``{"name": "ray", "address": ..., "max_concurrent_trials":
            ..., "resources_per_trial": ..., "num_cpus": ...}``: as Ray Tune trials, placed by Ray
            (:mod:`lightning_bigtrain.tune.ray_backend`; the ``[ray]`` extra).
    """

    def __init__(
        self,
        base: str | Path | Mapping[str, Any],
        space: Mapping[str, Any],
        objectives: Mapping[str, str] | None = None,
        trials: int = 20,
        output: str | Path = "runs/tune",
        study_name: str | None = None,
        storage: str | None = None,
        sampler: str = "auto",
        seed: int | None = None,
        pruner: str | dict[str, Any] | None = "median",
        report_every: int = 50,
        report_unit: str = "steps",
        monitor: str = "train_loss",
        device_memory: str | int | None = None,
        sample_shape: list[int] | None = None,
        optimizer: str = "adamw",
        overrides: Mapping[str, Any] | None = None,
        trial_timeout: float | None = None,
        checkpoint_every_n_steps: int | None = None,
        max_failures_in_a_row: int | None = 3,
        backend: str | Mapping[str, Any] = "local",
    ) -> None:
        self.base_path = None if isinstance(base, Mapping) else Path(base)
        self.base = dict(copy.deepcopy(base)) if isinstance(base, Mapping) else _load_yaml(Path(base))
        for section in ("model", "trainer"):
            if not isinstance(self.base.get(section), dict):
                raise TunerConfigError(f"`base`: the fit config has no `{section}:` section.")
        self.overrides = dict(overrides or {})
        with_overrides = SearchSpace.apply_values(self.base, self.overrides, what="overrides")
        self.space = SearchSpace(space, with_overrides)
        self.objectives = dict(objectives or {"val_loss": "minimize"})
        if not self.objectives:
            raise TunerConfigError("`objectives`: give at least one, e.g. `{val_loss: minimize}`.")
        for name, direction in self.objectives.items():
            if direction not in _DIRECTIONS:
                raise TunerConfigError(f"`objectives.{name}: {direction!r}`: choose minimize or maximize.")
        if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
            raise TunerConfigError(f"`trials={trials!r}`: an int >= 1.")
        self.trials = trials
        self.output = Path(output)
        self.study_name = study_name or self.output.name
        self.storage = storage or str(self.output / "study.journal")
        if sampler not in _SAMPLERS:
            raise TunerConfigError(f"`sampler={sampler!r}`: choose one of {', '.join(_SAMPLERS)}.")
        self.sampler = sampler
        self.seed = seed
        if pruner is not None and pruner != "none" and len(self.objectives) > 1:
            raise TunerConfigError(
                f"`pruning.pruner={pruner!r}` with {len(self.objectives)} objectives: Optuna's pruners take one "
                "objective. Give `pruner: none` for a multi-objective study, or keep one objective."
            )
        try:
            make_pruner(pruner)
        except ValueError as err:
            raise TunerConfigError(str(err)) from None
        self.pruner = None if pruner == "none" else pruner
        if isinstance(report_every, bool) or not isinstance(report_every, int) or report_every < 1:
            raise TunerConfigError(f"`report_every={report_every!r}`: an int >= 1.")
        if report_unit not in ("steps", "samples"):
            raise TunerConfigError(f"`report_unit={report_unit!r}`: choose steps or samples.")
        self.report_every = report_every
        self.report_unit = report_unit
        self.monitor = monitor
        if device_memory is not None:
            from lightning_bigtrain.planning import parse_bytes

            try:
                parse_bytes(device_memory, "device_memory")
            except (TypeError, ValueError) as err:
                raise TunerConfigError(f"`planner.device_memory={device_memory!r}`: {err}") from None
        self.device_memory = device_memory
        self.sample_shape = None if sample_shape is None else [int(v) for v in sample_shape]
        self.optimizer = optimizer
        self.trial_timeout = trial_timeout
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        if max_failures_in_a_row is not None and (isinstance(max_failures_in_a_row, bool)
                                                  or not isinstance(max_failures_in_a_row, int)
                                                  or max_failures_in_a_row < 1):  # fmt: skip
            raise TunerConfigError(f"`max_failures_in_a_row={max_failures_in_a_row!r}`: an int >= 1, or null.")
        self.max_failures_in_a_row = max_failures_in_a_row
        try:
            self.backend, self.backend_options = parse_backend(backend)
        except ValueError as err:
            raise TunerConfigError(str(err)) from None
        self._failed_in_a_row = 0
        self._study: Any = None

    def for_workers(self) -> Tuner:
        """A copy to ship to another process (a Ray trial): no open study (it reopens the storage), paths absolute."""
        clone = copy.copy(self)
        clone._study = None
        clone.output = self.output.resolve()
        if "://" not in self.storage:
            clone.storage = str(Path(self.storage).resolve())
        return clone

    # -- construction from the YAML of ``bigtrain tune --config`` ------------------------------------------------

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> Tuner:
        """A Tuner from a tune config (see ``configs/tune.yaml``); ``base`` is relative to the file's folder."""
        path = Path(path)
        raw = _load_yaml(path)
        known = {"base", "space", "objectives", "trials", "output", "study", "pruning", "planner", "overrides",
                 "trial_timeout", "checkpoint_every_n_steps", "max_failures_in_a_row", "backend"}  # fmt: skip
        unknown = sorted(set(raw) - known)
        if unknown:
            raise TunerConfigError(f"`{path}`: unknown section(s) {unknown}; a tune config takes {sorted(known)}.")
        if "base" not in raw or "space" not in raw:
            raise TunerConfigError(f"`{path}`: give `base:` (a bigtrain fit config) and `space:`.")
        base = Path(raw["base"])
        if not base.is_absolute():
            base = path.parent / base
        study = dict(raw.get("study") or {})
        pruning = dict(raw.get("pruning") or {})
        planner = dict(raw.get("planner") or {})
        for section, given, keys in (
            ("study", study, {"name", "storage", "sampler", "seed"}),
            ("pruning", pruning, {"pruner", "report_every", "report_unit", "monitor"}),
            ("planner", planner, {"device_memory", "sample_shape", "optimizer"}),
        ):
            bad = sorted(set(given) - keys)
            if bad:
                raise TunerConfigError(f"`{path}`: `{section}` has unknown key(s) {bad}; it takes {sorted(keys)}.")
        kwargs: dict[str, Any] = {
            "base": base,
            "space": raw["space"],
            "objectives": raw.get("objectives"),
            "trials": raw.get("trials", 20),
            "output": raw.get("output", "runs/tune"),
            "study_name": study.get("name"),
            "storage": study.get("storage"),
            "sampler": study.get("sampler", "auto"),
            "seed": study.get("seed"),
            "pruner": pruning.get("pruner", "median") if "pruning" in raw else None,
            "report_every": pruning.get("report_every", 50),
            "report_unit": pruning.get("report_unit", "steps"),
            "monitor": pruning.get("monitor", "train_loss"),
            "device_memory": planner.get("device_memory"),
            "sample_shape": planner.get("sample_shape"),
            "optimizer": planner.get("optimizer", "adamw"),
            "overrides": raw.get("overrides"),
            "trial_timeout": raw.get("trial_timeout"),
            "checkpoint_every_n_steps": raw.get("checkpoint_every_n_steps"),
            "backend": raw.get("backend", "local"),
        }
        if "max_failures_in_a_row" in raw:
            kwargs["max_failures_in_a_row"] = raw["max_failures_in_a_row"]
        backend = overrides.pop("backend", None)
        if isinstance(backend, str):  # `--backend NAME`: the config's options kept where it names the same backend
            given = kwargs["backend"]
            given = dict(given) if isinstance(given, Mapping) else {"name": given}
            kwargs["backend"] = {**given, "name": backend} if given.get("name") == backend else backend
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kwargs)

    # -- the study -------------------------------------------------------------------------------------------------

    @property
    def study(self) -> Any:
        """The Optuna study (created, or loaded when the storage already holds it)."""
        if self._study is None:
            import optuna

            directions: list[Any] = list(self.objectives.values())
            self.output.mkdir(parents=True, exist_ok=True)
            self._study = optuna.create_study(
                study_name=self.study_name,
                storage=open_storage(self.storage),
                sampler=self._sampler(self.seed),
                pruner=make_pruner(self.pruner),
                directions=directions,
                load_if_exists=True,
            )
            if list(self._study.directions) != [optuna.study.StudyDirection[d.upper()] for d in directions]:
                raise TunerConfigError(
                    f"The study {self.study_name!r} in {self.storage} was made with other objectives' directions; "
                    "give a new `study.name` or `output`."
                )
            self._study.set_user_attr(_ATTR + "objectives", list(self.objectives))
        return self._study

    def _sampler(self, seed: int | None) -> Any:
        import optuna

        if self.sampler == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        if self.sampler == "nsga2" or (self.sampler == "auto" and len(self.objectives) > 1):
            return optuna.samplers.NSGAIISampler(seed=seed)
        return optuna.samplers.TPESampler(seed=seed)

    def _worker_index(self) -> int:
        """How many drivers joined this output folder before this one (0 for the first): each worker seeds its
        sampler with ``seed + index``, so that workers sharing a study do not sample the same configurations,
        and a study run by one worker stays reproducible."""
        counter = self.output / "workers.count"
        lock = _TrialLock(self.output, "workers.lock")
        while not lock.acquire():
            time.sleep(0.05)
        try:
            index = int(counter.read_text()) if counter.exists() else 0
            counter.write_text(str(index + 1))
        finally:
            lock.release()
        return index

    def run(self, trials: int | None = None) -> Any:
        """Run trials until the study holds ``trials`` (default: the Tuner's) launched or refused ones, adopting
        trials whose driver died first. Returns the study."""
        import optuna

        target = self.trials if trials is None else trials
        if self.backend == "ray":
            from lightning_bigtrain.tune.ray_backend import run_on_ray

            return run_on_ray(self, target)
        study = self.study
        if self.seed is not None:
            study.sampler = self._sampler(self.seed + self._worker_index())
        while True:
            orphan = self._find_orphan()
            if orphan is not None:
                self._run_trial(orphan, adopted=True)
                continue
            started = [t for t in study.get_trials(deepcopy=False) if t.state != optuna.trial.TrialState.WAITING]
            if len(started) >= target:
                break
            trial = study.ask()
            self._new_trial(trial)
        running = [t.number for t in study.get_trials(deepcopy=False, states=[optuna.trial.TrialState.RUNNING])]
        if running:
            print(f"bigtrain tune: trials {running} are still running in other workers", flush=True)
        return study

    def _trial_dir(self, number: int) -> Path:
        return self.output / f"trial_{number:04d}"

    def _new_trial(self, trial: Any) -> None:
        prepared = self._prepare(trial)
        if prepared is not None:
            folder, lock = prepared
            try:
                self._launch(trial.number, trial._trial_id, folder, adopted=False)
            finally:
                lock.release()

    def _prepare(self, trial: Any) -> tuple[Path, _TrialLock] | None:
        """Sample the trial's values, write its config and check it against the planner, holding its folder's lock
        from before the folder is named in the study (so that it is never seen as an orphan). Returns the folder
        and the held lock for a trial to launch, or None for one told to the study here: refused by the planner
        (PRUNED, infeasible) or not preparable (FAIL, with the reason)."""
        import optuna

        folder = self._trial_dir(trial.number)
        lock = _TrialLock(folder)
        if not lock.acquire():
            raise RuntimeError(f"{folder} is locked by another driver: is `output` shared by two studies?")
        trial.set_user_attr(_ATTR + "dir", str(folder))
        try:
            values = self.space.suggest(trial)
            config = self.trial_config(values, folder, trial._trial_id)
            (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            refused = self._check_memory(config, trial)
        except Exception as err:  # a trial that cannot even be prepared fails alone, with the reason
            trial.set_user_attr(_ATTR + "reason", f"not prepared: {type(err).__name__}: {err}")
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            lock.release()
            print(f"bigtrain tune: trial {trial.number} failed before launch: {err}", flush=True)
            return None
        if refused is not None:
            trial.set_user_attr(_ATTR + "status", "infeasible")
            trial.set_user_attr(_ATTR + "reason", refused)
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            lock.release()
            print(f"bigtrain tune: trial {trial.number} not launched: {refused}", flush=True)
            return None
        return folder, lock

    def _find_orphan(self) -> Any:
        """A RUNNING trial of this study whose driver died (its folder's lock is free), or None."""
        import optuna

        for t in self.study.get_trials(deepcopy=False, states=[optuna.trial.TrialState.RUNNING]):
            folder = t.user_attrs.get(_ATTR + "dir")
            if folder is None:
                age = (datetime.datetime.now() - (t.datetime_start or datetime.datetime.now())).total_seconds()
                if age > 120:  # asked but its driver died before it made the folder
                    self.study.tell(t.number, state=optuna.trial.TrialState.FAIL)
                continue
            probe = _TrialLock(Path(folder))
            if probe.acquire():
                probe.release()
                return t
        return None

    def _run_trial(self, frozen: Any, adopted: bool) -> None:
        lock = self._claim(frozen)
        if lock is not None:
            try:
                self._launch(frozen.number, frozen._trial_id, Path(frozen.user_attrs[_ATTR + "dir"]), adopted=adopted)
            finally:
                lock.release()

    def _claim(self, frozen: Any) -> _TrialLock | None:
        """Take an orphaned trial over: its folder's lock (held on return), what is left of its process group
        stopped. None when another driver took it first or it is no longer RUNNING."""
        import optuna

        folder = Path(frozen.user_attrs[_ATTR + "dir"])
        lock = _TrialLock(folder)
        if not lock.acquire():
            return None  # another worker adopted it first
        if self.study._storage.get_trial(frozen._trial_id).state != optuna.trial.TrialState.RUNNING:
            lock.release()
            return None
        _kill_leftovers(folder)
        print(f"bigtrain tune: adopting trial {frozen.number} (its driver died); resuming it", flush=True)
        return lock

    def _launch(self, number: int, trial_id: int, folder: Path, adopted: bool) -> None:
        import optuna

        result_path = folder / "result.json"
        if adopted and result_path.exists():
            self._tell(number, folder)  # the run finished after its driver died
            return
        cmd = [sys.executable, "-m", "lightning_bigtrain.cli", "fit", "--config", str(folder / "config.yaml")]
        if self._checkpoint_dir(folder) is not None:
            cmd += ["--resume", "auto"]
        stopping = folder / _STOPPING
        stopping.unlink(missing_ok=True)
        launches = int(self.study._storage.get_trial(trial_id).user_attrs.get(_ATTR + "launches", 0)) + 1
        self.study._storage.set_trial_user_attr(trial_id, _ATTR + "launches", launches)
        print(f"bigtrain tune: trial {number} launched ({folder})", flush=True)
        with open(folder / "log.txt", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            (folder / "owner.json").write_text(json.dumps({"host": socket.gethostname(), "driver": os.getpid(),
                                                           "pgid": proc.pid}))  # fmt: skip
            try:
                rc = proc.wait(timeout=self.trial_timeout)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid)
                proc.wait()
                self.study._storage.set_trial_user_attr(trial_id, _ATTR + "reason",
                                                        f"ran past trial_timeout={self.trial_timeout}s")  # fmt: skip
                self.study.tell(number, state=optuna.trial.TrialState.FAIL)
                return
            except BaseException:
                _killpg(proc.pid)  # the driver is stopping: its trial stops with it, resumable by the next one
                raise
        if stopping.exists():  # its driver stopped it (a Ray driver's, from another process): left to adopt
            return
        if rc != 0 or not result_path.exists():
            tail = (folder / "log.txt").read_text(errors="replace")[-1500:]
            self.study._storage.set_trial_user_attr(trial_id, _ATTR + "reason", f"exit status {rc}: ...{tail}")
            self.study.tell(number, state=optuna.trial.TrialState.FAIL)
            print(f"bigtrain tune: trial {number} failed (exit status {rc}); see {folder / 'log.txt'}", flush=True)
            self._failed_in_a_row += 1
            if self.max_failures_in_a_row is not None and self._failed_in_a_row >= self.max_failures_in_a_row:
                raise TrialsFailingError(failing_message(self._failed_in_a_row, number, tail, folder))
            return
        self._failed_in_a_row = 0
        self._tell(number, folder)

    def _tell(self, number: int, folder: Path) -> None:
        import optuna

        result = json.loads((folder / "result.json").read_text())
        trial_id = self.study._storage.get_trial_id_from_study_id_trial_number(self.study._study_id, number)
        storage = self.study._storage
        storage.set_trial_user_attr(trial_id, _ATTR + "measures", result["measures"])
        storage.set_trial_user_attr(trial_id, _ATTR + "steps", result["steps"])
        storage.set_trial_user_attr(trial_id, _ATTR + "stopped_at_step_per_rank", result["stopped_at_step_per_rank"])
        if result["status"] == "pruned":
            storage.set_trial_user_attr(trial_id, _ATTR + "status", "pruned")
            self.study.tell(number, state=optuna.trial.TrialState.PRUNED)
            print(f"bigtrain tune: trial {number} pruned at step {result['pruned_at_step']}", flush=True)
            return
        values = []
        for name in self.objectives:
            value = result["measures"].get(name)
            if value is None or not math.isfinite(value):
                where = "a metric the module logs in validation" if name not in MEASURES else "a measure"
                storage.set_trial_user_attr(trial_id, _ATTR + "reason", f"objective {name!r} ({where}) was not "
                                            f"measured (got {value!r}): is it logged with that name?")  # fmt: skip
                self.study.tell(number, state=optuna.trial.TrialState.FAIL)
                print(f"bigtrain tune: trial {number} failed: objective {name!r} not measured", flush=True)
                return
            values.append(float(value))
        stale = {k: v for k, v in result.get("validated_at_step", {}).items() if v is not None and v != result["steps"]}
        if stale:
            warnings.warn(
                f"trial {number}: {', '.join(stale)} was last validated at step {min(stale.values())}, before the "
                f"run's last step ({result['steps']}); set `trainer.val_check_interval` to validate at the end.",
                BigtrainWarning,
                stacklevel=2,
            )
        storage.set_trial_user_attr(trial_id, _ATTR + "status", "complete")
        self.study.tell(number, values)
        print(f"bigtrain tune: trial {number} complete: {dict(zip(self.objectives, values, strict=True))}", flush=True)

    # -- one trial's config ----------------------------------------------------------------------------------------

    @staticmethod
    def _checkpoint_dir(folder: Path) -> Path | None:
        config = yaml.safe_load((folder / "config.yaml").read_text())
        for cb in config.get("trainer", {}).get("callbacks") or []:
            if _is_class(cb, "ModelCheckpoint") and cb.get("init_args", {}).get("dirpath"):
                return Path(cb["init_args"]["dirpath"])
        return None

    def trial_config(
        self, values: Mapping[str, Any], folder: Path, trial_id: int | None = None, overrides: bool = True
    ) -> dict[str, Any]:
        """The ``bigtrain fit`` config of one trial: base + overrides (unless ``overrides=False``: the base's own
        budget) + ``values``, its outputs moved into ``folder``, a ModelCheckpoint for resumption, and the
        :class:`TuneTrial` callback (pruning only with a ``trial_id``)."""
        config = SearchSpace.apply_values(self.base, self.overrides if overrides else {}, what="overrides")
        config = self.space.apply(config, values)
        trainer = config["trainer"]
        trainer["default_root_dir"] = str(folder)
        loggers = trainer.get("logger")
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            if isinstance(logger, dict):
                logger_args = logger.setdefault("init_args", {})
                logger_args["save_dir"] = str(folder)
                logger_args.setdefault("name", "logs")
        callbacks = [cb for cb in (trainer.get("callbacks") or []) if not _is_class(cb, "TuneTrial")]
        has_checkpoint = False
        for cb in callbacks:
            if _is_class(cb, "ModelCheckpoint"):
                cb.setdefault("init_args", {})["dirpath"] = str(folder / "checkpoints")
                has_checkpoint = True
            elif _is_class(cb, "RunReport"):
                cb.setdefault("init_args", {})["path"] = str(folder / "report.md")
        if not has_checkpoint and trainer.get("enable_checkpointing", True) is not False:
            args: dict[str, Any] = {"dirpath": str(folder / "checkpoints"), "save_last": True, "save_top_k": 0}
            if self.checkpoint_every_n_steps is not None:
                args["every_n_train_steps"] = int(self.checkpoint_every_n_steps)
            callbacks.append({"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": args})
        trial_args: dict[str, Any] = {
            "result_path": str(folder / "result.json"),
            "objectives": list(self.objectives),
            "report_every": self.report_every,
            "report_unit": self.report_unit,
            "monitor": self.monitor,
        }
        if self.pruner is not None and trial_id is not None:
            trial_args.update({"storage": self.storage, "study_name": self.study_name, "trial_id": int(trial_id),
                               "pruner": self.pruner})  # fmt: skip
        callbacks.append({"class_path": "lightning_bigtrain.tune.TuneTrial", "init_args": trial_args})
        trainer["callbacks"] = callbacks
        return config

    def fit_config(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """A ready ``bigtrain fit`` config for ``values`` (no tuning parts; outputs where the base puts them)."""
        config = SearchSpace.apply_values(self.base, self.overrides, what="overrides")
        return self.space.apply(config, values)

    # -- the planner's gate ------------------------------------------------------------------------------------------

    def _check_memory(self, config: dict[str, Any], trial: Any) -> str | None:
        """None when the planner predicts the config fits ``device_memory`` (or cannot tell: warned), else why not."""
        if self.device_memory is None:
            return None
        try:
            row, peak, budget = predict_peak(config, self.device_memory, self.sample_shape, self.optimizer)
        except _Unplannable as why:
            trial.set_user_attr(_ATTR + "planned", f"no: {why}")
            warnings.warn(f"trial {trial.number} launched unplanned: {why}", BigtrainWarning, stacklevel=2)
            return None
        trial.set_user_attr(_ATTR + "planned", row)
        trial.set_user_attr(_ATTR + "predicted_peak_bytes", peak)
        trial.set_constraint("memory", (peak - budget) / 2**30)
        if peak <= budget:
            return None
        return (f"the planner's `{row}` row predicts {peak / 2**30:.2f} GiB per device, over device_memory="
                f"{self.device_memory} ({budget / 2**30:.2f} GiB)")  # fmt: skip

    # -- what the study found ----------------------------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """One plain record per trial: number, status, params, measures, optimizer steps, note, best."""
        study = self.study
        best = {t.number for t in study.best_trials} if _has_complete(study) else set()
        out = []
        for t in study.get_trials(deepcopy=False):
            status = t.user_attrs.get(_ATTR + "status", t.state.name.lower())
            steps = t.user_attrs.get(_ATTR + "steps")
            note = str(t.user_attrs.get(_ATTR + "reason", ""))
            if status == "pruned" and t.last_step is not None:
                unit = " samples" if self.report_unit == "samples" else ""
                note = f"pruned at step {steps} (report {t.last_step}{unit})"
            out.append({"number": t.number, "status": status, "params": dict(t.params),
                        "measures": dict(t.user_attrs.get(_ATTR + "measures", {})), "steps": steps,
                        "note": note, "best": t.number in best})  # fmt: skip
        return out

    def table(self) -> str:
        """The study as a Markdown table: every trial, its parameters, objectives and measures, state and why."""
        return render_table(self.records(), [p.path for p in self.space.parameters], list(self.objectives))

    def summary(self) -> dict[str, Any]:
        """Counts of the study's trials by outcome."""
        counts: dict[str, int] = {}
        for t in self.study.get_trials(deepcopy=False):
            status = t.user_attrs.get(_ATTR + "status", t.state.name.lower())
            counts[status] = counts.get(status, 0) + 1
        return counts

    def write_best_configs(self) -> list[Path]:
        """Write each best trial's config as a ready ``bigtrain fit`` config under ``<output>/best/``."""
        if not _has_complete(self.study):
            return []
        out = self.output / "best"
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for t in self.study.best_trials:
            values = self.space.values_of(t.params)
            measures = t.user_attrs.get(_ATTR + "measures", {})
            header = (f"# bigtrain tune: study {self.study_name!r}, trial {t.number}: "
                      + ", ".join(f"{k}={_format(measures.get(k))}" for k in self.objectives) + "\n")  # fmt: skip
            path = out / f"trial_{t.number:04d}.yaml"
            path.write_text(header + yaml.safe_dump(self.fit_config(values), sort_keys=False))
            written.append(path)
        return written

    def pareto_plot(self, path: str | Path | None = None) -> Path | None:
        """Save the complete trials as a scatter plot with their Pareto front in red (matplotlib): the first two
        objectives; with one objective, that objective against the measured step time (the quality/speed trade).
        None, with a warning, without matplotlib."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            warnings.warn("no plot: matplotlib is not installed (`pip install lightning_bigtrain[tune]`).",
                          BigtrainWarning, stacklevel=2)  # fmt: skip
            return None
        path = Path(path or self.output / "pareto.png")
        done = [r for r in self.records() if r["status"] == "complete"]
        names = list(self.objectives)
        axes = (names[0], names[1]) if len(names) > 1 else ("step_time", names[0])
        maximize = tuple(self.objectives.get(n) == "maximize" for n in axes)
        points = [(float(r["measures"][axes[0]]), float(r["measures"][axes[1]])) for r in done]
        front = _front(points, (maximize[0], maximize[1]))
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.scatter([p[0] for p in points], [p[1] for p in points],
                   c=["tab:red" if i in front else "tab:blue" for i in range(len(points))])  # fmt: skip
        for r, (x, y) in zip(done, points, strict=True):
            ax.annotate(str(r["number"]), (x, y), fontsize=7)
        for k, name in enumerate(axes):
            label = f"{name} ({self.objectives[name]})" if name in self.objectives else f"{name} (s per step)"
            (ax.set_xlabel if k == 0 else ax.set_ylabel)(label)
        ax.set_title(f"{self.study_name}: {len(done)} complete trials (red: Pareto front)")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        return path


def render_table(
    records: list[dict[str, Any]], params: list[str], objectives: list[str], fmt: Callable[[Any], str] | None = None
) -> str:
    """A Markdown table of :meth:`Tuner.records`: parameters, objectives, then the measures that are not objectives
    (step time in ms, peak memory in MiB, bytes sent per step); ``fmt`` formats each value (default: 4 significant
    digits, scientific notation for the very small and very large)."""
    _fmt = fmt or _format
    extra = [m for m in ("step_time", "peak_memory", "bytes_sent") if m not in objectives]
    shown = {"step_time": "step ms", "peak_memory": "peak MiB", "bytes_sent": "sent/step"}
    head = ["trial", "state", *(p.rsplit(".", 1)[-1] for p in params), *objectives, *(shown[m] for m in extra),
            "steps", "note"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        m = r["measures"]
        cells = [f"{r['number']}{' *' if r['best'] else ''}", r["status"], *(_fmt(r["params"].get(p)) for p in params)]
        cells += [_fmt(m.get(n)) for n in objectives]
        for name in extra:
            value = m.get(name)
            if value is not None and name == "step_time":
                value = 1e3 * value
            elif value is not None and name == "peak_memory":
                value = value / 2**20
            cells.append(_fmt(value))
        cells += [_fmt(r["steps"]), str(r["note"]).replace("|", "/").replace("\n", " ")[:160]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "`*`: best (the Pareto front when there are several objectives)."]
    return "\n".join(lines)


def _front(points: list[tuple[float, float]], maximize: tuple[bool, bool]) -> set[int]:
    """Indices of the points no other point beats in both coordinates (each in its direction)."""
    signed = [((-x if maximize[0] else x), (-y if maximize[1] else y)) for x, y in points]
    front = set()
    for i, (a, b) in enumerate(signed):
        if not any((c <= a and d <= b) and (c < a or d < b) for j, (c, d) in enumerate(signed) if j != i):
            front.add(i)
    return front


def _has_complete(study: Any) -> bool:
    import optuna

    return bool(study.get_trials(deepcopy=False, states=[optuna.trial.TrialState.COMPLETE]))


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}"
    return str(value)


# -- the planner's side -------------------------------------------------------------------------------------------


def failing_message(count: int, number: int, reason: str, folder: Path | str) -> str:
    """What :class:`TrialsFailingError` says: how many trials failed in a row, the last one's last line."""
    last = [line for line in reason.splitlines() if line.strip()][-1:] or [""]
    return (
        f"{count} trials in a row failed; the last (trial {number}) ended with: {last[0].strip()[:300]} (see "
        f"{Path(folder) / 'log.txt'}). Fix the base config or its data and run the same command again: the failed "
        "trials stay recorded and the study continues."
    )


class _Unplannable(Exception):
    """The planner has no row for this configuration (the reason is the message)."""


def _plan_row(strategy: Any, rows: Mapping[str, Any]) -> str:
    from lightning_bigtrain.planning.planner import STRATEGY_NAMES

    by_name = {v: k for k, v in STRATEGY_NAMES.items()}
    if strategy is None or strategy in ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "single_device"):
        return "ddp"
    if isinstance(strategy, str):
        if strategy in by_name:
            return by_name[strategy]
        compressed = strategy.removeprefix("bigtrain_")  # bigtrain_ddp_powersgd -> the ddp_powersgd row
        if strategy.startswith("bigtrain_ddp_") and compressed in rows:
            return compressed
        if strategy.startswith(("bigtrain_zero3_tp", "bigtrain_zero3_pp")) and compressed in rows:  # TP / pipeline
            return compressed
        raise _Unplannable(f"the planner has no row for strategy {strategy!r}")
    if _is_class(strategy, "ZeroStrategy"):
        args = strategy.get("init_args", {})
        stage = int(args.get("stage", 3))
        offload = bool(args.get("offload_optimizer") or args.get("offload_params"))
        row = f"zero{stage}" + ("_offload" if offload and stage >= 2 else "")
        degree, stages = int(args.get("tensor_parallel", 1)), int(args.get("pipeline_parallel", 1))
        if degree > 1 and stages > 1:
            raise _Unplannable("the planner has no row for tensor and pipeline parallelism together")
        if degree > 1:
            row = f"zero{stage}_tp{degree}" + ("_sp" if args.get("sequence_parallel") else "")
        if stages > 1:  # one pipeline per data-parallel group of one: every stage is the zero3_pp row
            row = f"zero{stage}_pp{stages}" if f"zero{stage}_pp{stages}" in rows else f"zero3_pp{stages}"
        if row in rows:
            return row
    if _is_class(strategy, "DDPStrategy"):
        return "ddp"
    if _is_class(strategy, "CompressedDDPStrategy"):
        comp = strategy.get("init_args", {}).get("compression")
        name = comp if isinstance(comp, str) else None
        if name is not None and f"ddp_{name}" in rows:
            return f"ddp_{name}"
        return "ddp"
    shown = strategy.get("class_path") if isinstance(strategy, dict) else strategy
    raise _Unplannable(f"the planner has no row for strategy {shown!r}")


def _checkpoints_activations(strategy: Any) -> bool:
    """Whether the strategy config asks for activation checkpointing (``activation_checkpointing: true`` or block
    classes): the planner then counts the checkpointed blocks' activations, as the run will hold them."""
    if not isinstance(strategy, Mapping):
        return False
    value = (strategy.get("init_args") or {}).get("activation_checkpointing")
    return bool(value)


def _precision(trainer: Mapping[str, Any]) -> str:
    for plugin in trainer.get("plugins") or []:
        if _is_class(plugin, "BF16Precision"):
            return "bigtrain-bf16-" + str(plugin.get("init_args", {}).get("compensation", "kahan"))
    return str(trainer.get("precision", "32-true"))


def predict_peak(
    config: Mapping[str, Any], device_memory: str | int, sample_shape: list[int] | None, optimizer: str
) -> tuple[str, float, float]:
    """The planner's row for a fit config, its predicted peak bytes per device, and the budget in bytes."""

    import torch

    from lightning_bigtrain.planning import Cluster, Workload, parse_bytes, plan

    trainer = config.get("trainer", {})
    devices = trainer.get("devices", 1)
    if isinstance(devices, list):
        devices = len(devices)
    if not isinstance(devices, int) or devices < 1:
        raise _Unplannable(f"`trainer.devices={devices!r}` is not a device count")
    accelerator = "cuda" if str(trainer.get("accelerator", "cpu")) in ("gpu", "cuda") else "cpu"
    data_args = (config.get("data") or {}).get("init_args", {})
    shape: tuple[int, ...] | None = None
    dtype = torch.float32
    if "batch_size" in data_args and "block_size" in data_args:
        shape, dtype = (int(data_args["batch_size"]), int(data_args["block_size"])), torch.long
    elif "batch_size" in data_args and sample_shape:
        shape = (int(data_args["batch_size"]), *sample_shape)
    try:
        model = _instantiate_model(config["model"])
        result = plan(
            model,
            cluster=Cluster(
                devices=devices,
                num_nodes=int(trainer.get("num_nodes", 1)),
                device_memory=device_memory,
                accelerator=accelerator,
            ),
            workload=Workload(
                batch_shape=shape,
                input_dtype=dtype,
                optimizer=optimizer,
                precision=_precision(trainer),
                activation_checkpointing=_checkpoints_activations(trainer.get("strategy")),
            ),
        )
    except (TypeError, ValueError, ImportError, AttributeError, RuntimeError, NotImplementedError) as err:
        raise _Unplannable(f"the planner could not plan this configuration ({type(err).__name__}: {err})") from None
    row = _plan_row(trainer.get("strategy"), result.rows)
    return row, float(result.rows[row].peak_bytes), float(parse_bytes(device_memory, "device_memory"))


def _instantiate_model(spec: Mapping[str, Any]) -> Any:
    """The fit config's ``model:`` built as ``bigtrain fit`` (LightningCLI, through jsonargparse) builds it: nested
    ``class_path`` arguments (a Hugging Face model and its config inside the user's module) instantiated too."""
    import lightning as L
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(L.LightningModule, "model", fail_untyped=False)
    try:
        return parser.instantiate(parser.parse_object({"model": dict(spec)})).model
    except Exception as err:  # jsonargparse wraps what the module's own __init__ raised
        raise _Unplannable(f"the planner could not build the model ({type(err).__name__}: {err})") from None


# -- trial folders: locks and leftovers ---------------------------------------------------------------------------


class _TrialLock:
    """An exclusive ``flock`` on ``<trial>/owner.lock``, held by the driver running the trial. The kernel frees
    it when that process dies, however it dies: a free lock on a RUNNING trial is an orphan."""

    def __init__(self, folder: Path, name: str = "owner.lock") -> None:
        self.path = folder / name
        self.fd: int | None = None
        self.held = False

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = None
            return False
        self.held = True
        return True

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
        self.fd, self.held = None, False

    def __enter__(self) -> _TrialLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _kill_leftovers(folder: Path) -> None:
    """Stop what is left of a dead driver's trial (its process group) on this host before relaunching it."""
    owner = folder / "owner.json"
    if not owner.exists():
        return
    info = json.loads(owner.read_text())
    if info.get("host") == socket.gethostname() and info.get("pgid"):
        _killpg(int(info["pgid"]))
