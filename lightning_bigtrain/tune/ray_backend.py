"""Ray Tune as the executor of a study: ``Tuner(..., backend="ray")``, ``bigtrain tune --backend ray``.

The Optuna study stays the one record of the search (its storage holds every trial, its sampler proposes, its pruner
stops trials at the step level), so everything :class:`~lightning_bigtrain.tune.Tuner` does holds under Ray as it
does locally: the planner's gate, pruning under any strategy, resumption, several drivers on one storage, the table.
What Ray adds is where and how many trials run at once: each Optuna trial becomes one Ray Tune trial, placed by Ray
on a node with the resources it asks for (``resources_per_trial``; ``trainer.devices`` CPUs, or that many GPUs,
by default), at most ``max_concurrent_trials`` at a time.

- :class:`StudySearcher` is a Ray Tune ``Searcher`` that asks the study for the next trial: it samples the trial's
  values, writes its config and checks it against the planner in the driver, so an infeasible configuration is told
  to the study as a trial that never ran and never reaches Ray. It holds the trial folder's lock in the driver for
  as long as the Ray trial runs: a driver that dies frees it, and the next driver (Ray or not) adopts the trial.
- The Ray trial itself (a function trainable) runs the trial exactly as the local driver does: ``python -m
  lightning_bigtrain.cli fit --config <trial>/config.yaml`` in its own process group, under Lightning's own
  launcher. Ray's ``prepare_trainer`` is not used, so this package's strategies are not refused (it accepts only
  Ray's own strategies); a trial on several devices uses Lightning's DDP launcher inside the Ray trial's allotment
  (``CUDA_VISIBLE_DEVICES`` as Ray set it). The trial's outcome is told to the study by the Ray trial and reported
  to Ray as its result (``state``, the objectives).

On a cluster of several nodes the study's storage and ``output`` must be reachable from every node (a shared
filesystem for the default journal file, or an Optuna RDB URL as ``study.storage``), as for several local drivers.
"""

from __future__ import annotations

import os
import signal
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_bigtrain.warnings import NoEffectWarning

__all__ = ["BACKENDS", "RayOptions", "parse_backend", "run_on_ray"]

#: Where a study's trials run (``Tuner(backend=...)``).
BACKENDS = ("local", "ray")


class RayOptions:
    """Validated ``backend: {name: ray, ...}`` options.

    Args:
        address: The Ray cluster to join (``"auto"``, ``"ray://host:10001"``); ``None``: the one this process
            already joined, ``RAY_ADDRESS`` if set, or a local Ray started for the study (and stopped after it).
        max_concurrent_trials: Trials running at once; ``None``: as many as the resources allow.
        resources_per_trial: What each Ray trial asks for, e.g. ``{"cpu": 1}`` or ``{"cpu": 4, "gpu": 2}``;
            ``None``: ``trainer.devices`` CPUs (``accelerator: cpu``) or one CPU and ``trainer.devices`` GPUs.
        num_cpus: CPUs of a local Ray started for the study (``None``: all of this machine's).
    """

    KEYS = ("name", "address", "max_concurrent_trials", "resources_per_trial", "num_cpus")

    def __init__(
        self,
        address: str | None = None,
        max_concurrent_trials: int | None = None,
        resources_per_trial: Mapping[str, float] | None = None,
        num_cpus: int | None = None,
    ) -> None:
        if address is not None and not isinstance(address, str):
            raise ValueError(f"`backend.address={address!r}`: a Ray address string (e.g. 'auto'), or null.")
        for name, value in (("max_concurrent_trials", max_concurrent_trials), ("num_cpus", num_cpus)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"`backend.{name}={value!r}`: an int >= 1, or null.")
        if resources_per_trial is not None:
            if not isinstance(resources_per_trial, Mapping) or not resources_per_trial:
                raise ValueError(
                    f"`backend.resources_per_trial={resources_per_trial!r}`: a mapping such as {{cpu: 1}} or "
                    "{cpu: 4, gpu: 2}."
                )
            for key, amount in resources_per_trial.items():
                if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
                    raise ValueError(f"`backend.resources_per_trial.{key}={amount!r}`: a number >= 0.")
        self.address = address
        self.max_concurrent_trials = max_concurrent_trials
        self.resources_per_trial = None if resources_per_trial is None else dict(resources_per_trial)
        self.num_cpus = num_cpus

    def resources(self, trainer: Mapping[str, Any]) -> dict[str, float]:
        """``resources_per_trial``, or what the fit config's ``trainer.devices`` and ``accelerator`` ask for."""
        if self.resources_per_trial is not None:
            return dict(self.resources_per_trial)
        devices = trainer.get("devices", "auto")
        if isinstance(devices, (list, tuple)):
            devices = len(devices)
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(
                f"`trainer.devices={devices!r}` does not say how many devices a trial uses: give "
                "`backend.resources_per_trial` (e.g. {cpu: 2} or {cpu: 1, gpu: 2}) for Ray to place trials."
            )
        accelerator = str(trainer.get("accelerator", "auto"))
        if accelerator == "auto":
            import torch

            accelerator = "gpu" if torch.cuda.is_available() else "cpu"
        if accelerator in ("gpu", "cuda"):
            return {"cpu": 1, "gpu": devices}
        return {"cpu": devices}


def parse_backend(spec: str | Mapping[str, Any] | None) -> tuple[str, RayOptions | None]:
    """``"local"``, ``"ray"`` or ``{name: ray, address: ..., ...}`` -> the backend's name and its options."""
    if spec is None:
        spec = "local"
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"`backend={spec!r}`: 'local', 'ray', or a mapping {{name: ray, ...}}.")
    name = spec.get("name", "local")
    if name not in BACKENDS:
        raise ValueError(f"`backend.name={name!r}`: choose one of {', '.join(BACKENDS)}.")
    unknown = sorted(set(spec) - set(RayOptions.KEYS))
    if unknown:
        raise ValueError(f"`backend` has unknown key(s) {unknown}; it takes {list(RayOptions.KEYS)}.")
    if name == "local":
        if set(spec) - {"name"}:
            raise ValueError(f"`backend`: {sorted(set(spec) - {'name'})} are options of `name: ray`.")
        return "local", None
    try:
        import ray
        import ray.tune  # noqa: F401
    except ImportError:
        raise ValueError(
            "`backend: ray` needs Ray Tune: pip install 'lightning-bigtrain[ray]' (or 'ray[tune]')."
        ) from None
    return "ray", RayOptions(**{k: v for k, v in spec.items() if k != "name"})


def _searcher_class() -> type:
    from ray.tune.search import Searcher

    class StudySearcher(Searcher):
        """A Ray Tune ``Searcher`` over a :class:`~lightning_bigtrain.tune.Tuner`'s Optuna study: each suggestion is
        one study trial, prepared and planned here (in the driver), its folder's lock held here until Ray reports
        the trial done. Orphaned trials (their driver died) are adopted first; trials the planner refuses are told
        to the study and never become Ray trials. Finished when the study holds ``target`` started trials."""

        def __init__(self, tuner: Any, target: int) -> None:
            super().__init__()
            self.tuner = tuner
            self.target = target
            self.live: dict[str, tuple[int, Any]] = {}  # Ray trial id -> (study trial number, its folder's lock)
            self.failed_in_a_row = 0
            self.stopped: str | None = None  # why the search stopped early (trials failing one after another)

        def suggest(self, trial_id: str) -> Any:  # a config, or Searcher.FINISHED (a str; Ray's hint omits it)
            import optuna

            if self.stopped is not None:
                return Searcher.FINISHED
            study = self.tuner.study
            while True:
                orphan = self.tuner._find_orphan()
                if orphan is not None:
                    lock = self.tuner._claim(orphan)
                    if lock is None:
                        continue
                    return self._start(trial_id, orphan.number, orphan._trial_id, lock, adopted=True)
                started = [t for t in study.get_trials(deepcopy=False) if t.state != optuna.trial.TrialState.WAITING]
                if len(started) >= self.target:
                    return Searcher.FINISHED
                trial = study.ask()
                prepared = self.tuner._prepare(trial)
                if prepared is not None:
                    return self._start(trial_id, trial.number, trial._trial_id, prepared[1], adopted=False)

        def _start(self, trial_id: str, number: int, study_trial_id: int, lock: Any, adopted: bool) -> dict[str, Any]:
            self.live[trial_id] = (number, lock)
            folder = str(self.tuner._trial_dir(number))
            return {"number": number, "trial_id": study_trial_id, "folder": folder, "adopted": adopted}

        def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
            import optuna

            if trial_id not in self.live:
                return
            number, lock = self.live.pop(trial_id)
            try:
                study = self.tuner.study
                frozen = study._storage.get_trial(
                    study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)
                )
                if error and frozen.state == optuna.trial.TrialState.RUNNING:
                    # The Ray trial died (its worker or node lost): the fit is stopped and the trial failed, with
                    # the reason; its checkpoints stay for a study that retries it by hand.
                    from lightning_bigtrain.tune.tuner import _ATTR, _kill_leftovers

                    _kill_leftovers(Path(frozen.user_attrs[_ATTR + "dir"]))
                    study._storage.set_trial_user_attr(frozen._trial_id, _ATTR + "reason",
                                                       "its Ray trial failed (see Ray's log of the trial)")  # fmt: skip
                    study.tell(number, state=optuna.trial.TrialState.FAIL)
                    frozen = study._storage.get_trial(frozen._trial_id)
                if frozen.state == optuna.trial.TrialState.FAIL:
                    self.failed_in_a_row += 1
                    limit = self.tuner.max_failures_in_a_row
                    if limit is not None and self.failed_in_a_row >= limit:
                        from lightning_bigtrain.tune.tuner import failing_message

                        self.stopped = failing_message(self.failed_in_a_row, number,
                                                       str(frozen.user_attrs.get("bigtrain:reason", "")),
                                                       self.tuner._trial_dir(number))  # fmt: skip
                else:
                    self.failed_in_a_row = 0
            finally:
                lock.release()

        def release_all(self) -> None:
            """The driver is stopping (interrupted, or Ray stopped the experiment): the fits of the trials still live
            are stopped (their process groups outlive the Ray workers that launched them) and their locks freed, so
            that the next driver adopts them and resumes each from its last checkpoint."""
            from lightning_bigtrain.tune.tuner import _STOPPING, _kill_leftovers

            for number, lock in self.live.values():
                folder = self.tuner._trial_dir(number)
                (folder / _STOPPING).touch()  # its Ray trial, if still running, then tells the study nothing
                _kill_leftovers(folder)
                lock.release()
            self.live.clear()

        def save(self, checkpoint_path: str) -> None:  # the study's storage is the searcher's state
            Path(checkpoint_path).write_text("the Optuna study's storage holds this search's state\n")

        def restore(self, checkpoint_path: str) -> None:
            pass

    return StudySearcher


def _ray_trial(config: dict[str, Any], tuner: Any, cwd: str) -> None:
    """One Ray Tune trial: the study trial ``config["number"]``, run as the local driver runs it; its outcome told
    to the study and reported to Ray."""
    import optuna
    from ray import tune

    if os.path.isdir(cwd):
        os.chdir(cwd)  # the fit config's relative paths (data, outputs) resolve as in the driver
    tuner.max_failures_in_a_row = None  # counted by the driver, over every Ray trial
    tuner._launch(config["number"], config["trial_id"], Path(config["folder"]), adopted=config["adopted"])
    frozen = tuner.study._storage.get_trial(config["trial_id"])
    report: dict[str, Any] = {"number": config["number"], "state": frozen.state.name.lower()}
    if frozen.state == optuna.trial.TrialState.COMPLETE:
        report.update(zip(tuner.objectives, frozen.values, strict=True))
    tune.report(report)


def _joins(options: RayOptions, initialized: bool) -> str | None:
    """The Ray the study joins (None: a local one started for it), warning about the options that then do nothing."""
    joins = "this process's Ray" if initialized else None
    if joins is None and (options.address is not None or os.environ.get("RAY_ADDRESS")):
        joins = f"the Ray cluster at {options.address or os.environ['RAY_ADDRESS']!r}"
    if joins is not None and options.num_cpus is not None:
        warnings.warn(
            f"`backend.num_cpus={options.num_cpus}` has no effect: the study joins {joins}, whose CPUs are its own; "
            "it sizes a local Ray started for the study only.",
            NoEffectWarning,
            stacklevel=3,
        )
    if initialized and options.address is not None:
        warnings.warn(
            f"`backend.address={options.address!r}` has no effect: this process already joined a Ray cluster "
            "(ray.init was called before), and the study runs there.",
            NoEffectWarning,
            stacklevel=3,
        )
    return joins


def _remembering(handler: Any, received: list[int]) -> Any:
    def on_signal(signum: int, frame: Any) -> Any:
        received.append(signum)
        return handler(signum, frame)

    return on_signal


def run_on_ray(tuner: Any, target: int) -> Any:
    """Run ``tuner``'s study on Ray Tune until it holds ``target`` started trials; returns the study. Raises
    :class:`~lightning_bigtrain.tune.TrialsFailingError` when ``max_failures_in_a_row`` trials failed."""
    import ray
    from ray import tune

    from lightning_bigtrain.tune.tuner import TrialsFailingError

    options: RayOptions = tuner.backend_options
    started = False
    received: list[int] = []  # a signal the caller's handler took while Ray waited
    joins = _joins(options, ray.is_initialized())
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"address": options.address, "include_dashboard": False, "log_to_driver": False}
        if joins is None:
            kwargs["num_cpus"] = options.num_cpus
        # Ray installs its own SIGTERM handler (it logs and aborts); keep the caller's, which `bigtrain tune` uses to
        # stop the trials' fits and free their locks on the way out.
        main = threading.current_thread() is threading.main_thread()
        handler = signal.getsignal(signal.SIGTERM) if main else None
        ray.init(**kwargs)
        if callable(handler):
            signal.signal(signal.SIGTERM, _remembering(handler, received))
        elif handler is not None:
            signal.signal(signal.SIGTERM, handler)
        started = True
    study = tuner.study
    if tuner.seed is not None:
        study.sampler = tuner._sampler(tuner.seed + tuner._worker_index())
    resources = options.resources(tuner.fit_config({})["trainer"])
    searcher = _searcher_class()(tuner, target)
    worker = tuner.for_workers()
    trainable = tune.with_resources(tune.with_parameters(_ray_trial, tuner=worker, cwd=os.getcwd()), resources)
    ray_tuner = tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=searcher, num_samples=target, max_concurrent_trials=options.max_concurrent_trials
        ),
        run_config=tune.RunConfig(
            name=f"{tuner.study_name}-ray", storage_path=str(Path(tuner.output).resolve() / "ray"), verbose=0
        ),
    )
    print(f"bigtrain tune: running trials on Ray ({resources} per trial, "
          f"{options.max_concurrent_trials or 'as many as fit'} at a time)", flush=True)  # fmt: skip
    try:
        ray_tuner.fit()
    except SystemExit:
        if received:  # Ray's wait turns the handler's exit into SystemExit(1): keep the signal's status
            raise SystemExit(128 + received[0]) from None
        raise
    finally:
        searcher.release_all()
        if started:
            ray.shutdown()
    if searcher.stopped is not None:
        raise TrialsFailingError(searcher.stopped)
    return study
