"""`bigtrain tune` on Ray Tune (`backend: ray`): the options checked at construction; a study whose trials run as
Ray Tune trials, two at a time on one CPU each, under this package's strategies (Ray's own `prepare_trainer` would
refuse them), with the planner's gate in front; and a study whose driver died, continued on Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lightning_bigtrain.tune import Tuner, TunerConfigError
from lightning_bigtrain.tune.ray_backend import RayOptions
from tests.tune.test_tune import _base, _env, _write_tune, kill_study_mid_trial, start_slow_study

pytest.importorskip("ray.tune")

SPACE = {"model.init_args.lr": {"low": 1e-3, "high": 3e-2, "log": True}}


@pytest.mark.parametrize(
    ("backend", "needle"),
    [
        ("rya", "backend.name='rya'"),
        ({"name": "ray", "max_concurrent_trials": 0}, "backend.max_concurrent_trials=0"),
        ({"name": "ray", "resources_per_trial": {"cpu": -1}}, "backend.resources_per_trial.cpu=-1"),
        ({"name": "ray", "workers": 2}, "unknown key(s) ['workers']"),
        ({"name": "local", "address": "auto"}, "options of `name: ray`"),
        (3, "backend=3"),
    ],
)
def test_bad_backend_is_named(backend, needle):
    with pytest.raises(TunerConfigError) as err:
        Tuner(_base(), SPACE, backend=backend)
    assert needle in str(err.value)


def test_resources_per_trial_follow_the_fit_config():
    assert RayOptions().resources({"accelerator": "cpu", "devices": 2}) == {"cpu": 2}
    assert RayOptions().resources({"accelerator": "gpu", "devices": [0, 1]}) == {"cpu": 1, "gpu": 2}
    assert RayOptions(resources_per_trial={"cpu": 3}).resources({"devices": "auto"}) == {"cpu": 3}
    with pytest.raises(ValueError, match=r"give `backend\.resources_per_trial`"):
        RayOptions().resources({"accelerator": "cpu", "devices": "auto"})


def test_options_that_cannot_act_warn(monkeypatch):
    import warnings

    from lightning_bigtrain.tune.ray_backend import _joins
    from lightning_bigtrain.warnings import NoEffectWarning

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _joins(RayOptions(num_cpus=2), initialized=False) is None  # a local Ray, sized by num_cpus: silent
    with pytest.warns(NoEffectWarning, match=r"backend\.num_cpus=2.*'auto'"):
        _joins(RayOptions(address="auto", num_cpus=2), initialized=False)
    with pytest.warns(NoEffectWarning, match=r"backend\.num_cpus=2.*this process's Ray"):
        _joins(RayOptions(num_cpus=2), initialized=True)
    with pytest.warns(NoEffectWarning, match=r"backend\.address='auto'.*already joined"):
        _joins(RayOptions(address="auto"), initialized=True)
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    with pytest.warns(NoEffectWarning, match="ray://head:10001"):
        _joins(RayOptions(num_cpus=2), initialized=False)


def test_cli_backend_keeps_the_configs_ray_options(tmp_path):
    path = _write_tune(tmp_path, _base(), backend={"name": "ray", "max_concurrent_trials": 2})
    assert Tuner.from_yaml(path, backend="ray").backend_options.max_concurrent_trials == 2
    assert Tuner.from_yaml(path, backend="local").backend == "local"


@pytest.mark.integration
def test_trials_run_on_ray_two_at_a_time_under_our_strategies(tmp_path, monkeypatch):
    import optuna

    for key, value in _env().items():
        monkeypatch.setenv(key, value)
    space = {**SPACE, "data.init_args.batch_size": {"choices": [16, 8192]},
             "trainer.strategy": {"choices": ["bigtrain_zero2", "bigtrain_ddp_powersgd"]}}  # fmt: skip
    ray = {"name": "ray", "max_concurrent_trials": 2, "num_cpus": 2}
    tuner = Tuner(_base(), space, trials=5, output=tmp_path / "s", seed=0, pruner=None, device_memory="24MB",
                  sample_shape=[1, 28, 28], backend=ray)  # fmt: skip
    tuner.study.enqueue_trial({"data.init_args.batch_size": 8192, "trainer.strategy": "bigtrain_zero2"})
    for strategy in ("bigtrain_zero2", "bigtrain_ddp_powersgd") * 2:
        tuner.study.enqueue_trial({"data.init_args.batch_size": 16, "trainer.strategy": strategy})
    tuner.run()
    trials = tuner.study.get_trials()
    states = [t.state for t in trials]
    assert states == [optuna.trial.TrialState.PRUNED] + [optuna.trial.TrialState.COMPLETE] * 4, states
    refused = Path(trials[0].user_attrs["bigtrain:dir"])
    assert trials[0].user_attrs["bigtrain:status"] == "infeasible" and not (refused / "log.txt").exists()
    done = trials[1:]
    assert all(t.user_attrs["bigtrain:launches"] == 1 for t in done)
    assert sorted(t.params["trainer.strategy"] for t in done) == ["bigtrain_ddp_powersgd"] * 2 + ["bigtrain_zero2"] * 2
    for t in done:  # each a real fit under the strategy it was given
        result = json.loads((Path(t.user_attrs["bigtrain:dir"]) / "result.json").read_text())
        assert result["status"] == "complete" and result["steps"] == 12
    # Two at a time: some trial started before another had finished (Ray ran them side by side).
    assert any(a.datetime_start < b.datetime_complete and b.datetime_start < a.datetime_complete
               for a in done for b in done if a.number < b.number)  # fmt: skip
    assert (tmp_path / "s" / "ray").is_dir()  # Ray Tune's own record of the experiment
    assert "infeasible" in tuner.table()


@pytest.mark.integration
def test_ray_driver_stops_when_every_trial_fails_the_same_way(tmp_path, monkeypatch):
    import optuna

    from lightning_bigtrain.tune import TrialsFailingError

    for key, value in _env().items():
        monkeypatch.setenv(key, value)
    base = _base()
    base["data"]["init_args"]["data_dir"] = str(tmp_path / "no-data-here")
    tuner = Tuner(base, SPACE, trials=6, output=tmp_path / "s", pruner=None, max_failures_in_a_row=2,
                  backend={"name": "ray", "max_concurrent_trials": 1, "num_cpus": 2})  # fmt: skip
    with pytest.raises(TrialsFailingError, match=r"2 trials in a row failed.*not set up"):
        tuner.run()
    trials = tuner.study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.FAIL] * 2  # not all six spent on it


@pytest.mark.integration
def test_killed_study_continues_on_ray(tmp_path):
    import optuna

    path, cmd = kill_study_mid_trial(tmp_path)  # a local driver and its trial, killed after a checkpoint
    run = subprocess.run([*cmd, "--backend", "ray"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "adopting trial 0" in run.stdout and "running trials on Ray" in run.stdout
    (trial,) = Tuner.from_yaml(path).study.get_trials()
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.user_attrs["bigtrain:launches"] == 2
    folder = Path(trial.user_attrs["bigtrain:dir"])
    assert json.loads((folder / "result.json").read_text())["steps"] == 48
    assert "Restoring states from the checkpoint path" in (folder / "log.txt").read_text()


@pytest.mark.integration
def test_a_stopped_ray_driver_stops_its_trials_fit_and_leaves_it_to_adopt(tmp_path):
    """SIGTERM to a `--backend ray` driver mid-trial: the trial's fit (a process group that outlives Ray's workers)
    is stopped with the driver, and the trial stays RUNNING with its lock free; the next driver adopts it."""
    import optuna

    from lightning_bigtrain.tune.tuner import _TrialLock

    path, _cmd, driver, ckpt = start_slow_study(tmp_path, "--backend", "ray")
    pgid = json.loads((ckpt.parent.parent / "owner.json").read_text())["pgid"]
    driver.send_signal(signal.SIGTERM)
    out = driver.communicate(timeout=180)[0]
    assert driver.returncode == 128 + signal.SIGTERM, out[-3000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the trial's fit (process group {pgid}) still runs after its Ray driver stopped")
    (trial,) = Tuner.from_yaml(path).study.get_trials()
    assert trial.state == optuna.trial.TrialState.RUNNING
    lock = _TrialLock(ckpt.parent.parent)
    assert lock.acquire()  # free: the next driver adopts the trial (as in test_killed_study_continues_on_ray)
    lock.release()
    assert ckpt.exists()  # from the checkpoint its fit wrote
