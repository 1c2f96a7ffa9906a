"""`bigtrain tune`: the search space and config checks, the planner's gate, step-level pruning on 2 ranks, a
killed study that continues, and two workers on one storage. Trials are real `bigtrain fit` runs of the
Fashion-MNIST CNN on a small subset."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from lightning_bigtrain.tune import SearchSpace, Tuner, TunerConfigError

ROOT = Path(__file__).resolve().parents[2]
BIGTRAIN = str(Path(sys.executable).with_name("bigtrain"))


def _base(devices: int = 1) -> dict:
    return {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": devices, "strategy": "ddp" if devices > 1 else "auto",
                    "max_epochs": 1, "limit_train_batches": 12, "limit_val_batches": 2,
                    "enable_progress_bar": False, "enable_model_summary": False, "logger": False},
        "model": {"class_path": "lightning_bigtrain.models.FashionCNN", "init_args": {"channels": [4, 8]}},
        "data": {"class_path": "lightning_bigtrain.data.FashionMNISTDataModule",
                 "init_args": {"batch_size": 32, "subset": 512}},
    }  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "BIGTRAIN_DATA": os.environ.get("BIGTRAIN_DATA", str(ROOT / "data")),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip


def _write_tune(tmp_path: Path, base: dict, **extra: object) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    config = {"base": "base.yaml", "output": str(tmp_path / "study"), "study": {"name": "t", "seed": 0},
              "space": {"model.init_args.lr": {"low": 1e-3, "high": 3e-2, "log": True}}, **extra}  # fmt: skip
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# -- bad input: named, at construction --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"model.init_args.lr": {"low": 1e-2, "high": 1e-3}}, "is above `high`"),
        ({"model.init_args.lr": {"low": 0.0, "high": 1.0, "log": True}}, "log-scale range needs `low` > 0"),
        ({"model.init_args.lr": {"low": 1e-3}}, "needs both `low` and `high`"),
        ({"model.init_args.lr": {"choices": [[1, 2]]}}, "Name structured choices with a mapping"),
        ({"model.init_args.lr": {"chioces": [1, 2]}}, "unknown key(s) ['chioces']"),
        ({"trainer.stratgy.x": {"choices": ["ddp"]}}, "has no `trainer.stratgy`"),
        ({"model.init_args.lr": 0.1}, "give a mapping"),
    ],
)
def test_bad_search_space_is_named(spec, needle):
    with pytest.raises(ValueError) as err:
        SearchSpace(spec, _base())
    assert needle in str(err.value)
    assert next(iter(spec)).split(".")[0] in str(err.value)


def test_bad_tune_config_is_named(tmp_path):
    with pytest.raises(TunerConfigError, match="Optuna's pruners take one objective"):
        Tuner(_base(), {"model.init_args.lr": {"low": 1e-3, "high": 1e-2}},
              objectives={"val_loss": "minimize", "step_time": "minimize"}, pruner="median")  # fmt: skip
    with pytest.raises(TunerConfigError, match="choose minimize or maximize"):
        Tuner(_base(), {"model.init_args.lr": {"low": 1e-3, "high": 1e-2}}, objectives={"val_loss": "lower"})
    with pytest.raises(TunerConfigError, match="not a pruner"):
        Tuner(_base(), {"model.init_args.lr": {"low": 1e-3, "high": 1e-2}}, pruner="medain")
    with pytest.raises(TunerConfigError, match="unknown section"):
        Tuner.from_yaml(_write_tune(tmp_path, _base(), sapce={}))
    with pytest.raises(ValueError, match=r"`overrides\.trainer\.nope\.x`"):
        Tuner(_base(), {"model.init_args.lr": {"low": 1e-3, "high": 1e-2}}, overrides={"trainer.nope.x": 1})


def test_structured_choices_and_trial_config(tmp_path):
    import optuna

    tuner = Tuner(_base(), {"model.init_args.channels": {"choices": {"small": [4, 8], "wide": [16, 32]}},
                            "data.init_args.batch_size": {"choices": [16, 32]}},
                  output=tmp_path / "s", pruner=None)  # fmt: skip
    values = tuner.space.suggest(optuna.trial.FixedTrial({"model.init_args.channels": "wide",
                                                          "data.init_args.batch_size": 16}))  # fmt: skip
    assert values == {"model.init_args.channels": [16, 32], "data.init_args.batch_size": 16}
    config = tuner.trial_config(values, tmp_path / "s" / "trial_0000")
    assert config["model"]["init_args"]["channels"] == [16, 32]
    names = [cb["class_path"].rsplit(".", 1)[-1] for cb in config["trainer"]["callbacks"]]
    assert names == ["ModelCheckpoint", "TuneTrial"]
    assert "TuneTrial" not in yaml.safe_dump(tuner.fit_config(values))


TUNE_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if "base" in yaml.safe_load(p.read_text()))


@pytest.mark.parametrize("name", TUNE_CONFIGS)
def test_every_tune_config_makes_trials_that_parse_and_plan(name, tmp_path, capsys, monkeypatch):
    """Each shipped tune config: loads, its sampled trial config is a valid `bigtrain fit` config, and the planner
    has a row for it (so that the gate acts)."""
    import optuna

    from lightning_bigtrain.cli import main
    from lightning_bigtrain.tune.tuner import predict_peak

    monkeypatch.chdir(ROOT)
    tuner = Tuner.from_yaml(ROOT / "configs" / name, output=str(tmp_path / "s"))
    trial = optuna.trial.FixedTrial({p.path: _first_choice(p) for p in tuner.space.parameters})
    config = tuner.trial_config(tuner.space.suggest(trial), tmp_path / "s" / "trial_0000", trial_id=0)
    (tmp_path / "trial.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(tmp_path / "trial.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None), capsys.readouterr().err[-3000:]
    assert tuner.device_memory is not None
    row, peak, budget = predict_peak(config, tuner.device_memory, tuner.sample_shape, tuner.optimizer)
    assert 0 < peak < budget, (row, peak, budget)


def _first_choice(p):
    if p.choices is not None:
        return next(iter(p.choices)) if p.named else next(iter(p.choices.values()))
    return p.low


# -- the planner's gate ---------------------------------------------------------------------------------------------


def test_infeasible_configuration_is_recorded_and_never_launched(tmp_path):
    import optuna

    space = {"data.init_args.batch_size": {"choices": [16, 8192]}}
    tuner = Tuner(_base(), space, trials=4, output=tmp_path / "s", sampler="random", seed=0, pruner=None,
                  device_memory="24MB", sample_shape=[1, 28, 28])  # fmt: skip
    for batch in (8192, 8192):  # both refused before anything starts
        tuner.study.enqueue_trial({"data.init_args.batch_size": batch})
    tuner.run(trials=2)
    trials = tuner.study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.PRUNED] * 2
    for t in trials:
        assert t.user_attrs["bigtrain:status"] == "infeasible"
        assert "over device_memory=24MB" in t.user_attrs["bigtrain:reason"]
        assert t.constraints["memory"] > 0
        folder = Path(t.user_attrs["bigtrain:dir"])
        assert not (folder / "log.txt").exists() and not (folder / "result.json").exists()
    assert "infeasible" in tuner.table()


def _hf_base() -> dict:
    """A fit config of a model this project did not write, as a Hugging Face user writes it for LightningCLI: their
    LightningModule with a GPT-2 built from its config, both nested `class_path`s."""
    config = {"class_path": "transformers.GPT2Config",
              "init_args": {"vocab_size": 96, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2,
                            "bos_token_id": 0, "eos_token_id": 0}}  # fmt: skip
    base = _base()
    base["model"] = {"class_path": "tests.helpers.tune.CausalLM", "init_args": {
        "model": {"class_path": "transformers.GPT2LMHeadModel", "init_args": {"config": config}}}}  # fmt: skip
    base["data"] = {"class_path": "lightning_bigtrain.data.ShakespeareDataModule",
                    "init_args": {"block_size": 32, "batch_size": 8, "subset": 512}}  # fmt: skip
    return base


HF_EMBD = "model.init_args.model.init_args.config.init_args.n_embd"


def test_nested_hugging_face_model_is_planned(tmp_path):
    """The planner builds the model as `bigtrain fit` does (nested class_paths instantiated), so a Hugging Face model
    inside the user's module is planned, not launched unplanned."""
    from lightning_bigtrain.tune.tuner import predict_peak

    tuner = Tuner(_hf_base(), {HF_EMBD: {"choices": [32, 1024]}}, output=tmp_path / "s")
    peaks = {}
    for embd in (32, 1024):
        config = tuner.fit_config({HF_EMBD: embd})
        row, peaks[embd], _ = predict_peak(config, "64MB", None, "adamw")
        assert row == "ddp"
    # GPT-2 at width 1024 holds ~25M parameters (AdamW: 16 bytes each) against ~0.1M at width 32.
    assert peaks[1024] > 300 * 2**20 > 64 * 2**20 > peaks[32]


def test_activation_checkpointing_in_the_strategy_is_planned_as_the_run_holds_it(tmp_path):
    """A trial whose strategy checkpoints activations is gated by the planner's count of checkpointed activations
    (before: by the plain count, so a configuration that fits only with checkpointing was never launched)."""
    import optuna

    from lightning_bigtrain.planning import Cluster, Workload, plan
    from lightning_bigtrain.tune.tuner import _instantiate_model, predict_peak

    base = _hf_base()
    base["trainer"].update(devices=2, strategy={"class_path": "lightning_bigtrain.strategies.ZeroStrategy",
                                                "init_args": {"stage": 3}})  # fmt: skip
    base["data"]["init_args"]["batch_size"] = 64
    key = "trainer.strategy.init_args.activation_checkpointing"
    tuner = Tuner(base, {key: {"choices": [False, True]}}, output=tmp_path / "s")
    peaks = {}
    for choice in (False, True):
        values = tuner.space.suggest(optuna.trial.FixedTrial({key: choice}))
        row, peaks[choice], _ = predict_peak(tuner.fit_config(values), "1GB", None, "adamw")
        assert row == "zero3"
    expected = plan(
        _instantiate_model(base["model"]),
        cluster=Cluster(devices=2, device_memory="1GB", accelerator="cpu"),
        workload=Workload(batch_shape=(64, 32), input_dtype=torch.long, activation_checkpointing=True),
    )
    assert peaks[True] == expected.rows["zero3"].peak_bytes < peaks[False]


@pytest.mark.integration
def test_hugging_face_model_is_tuned_with_the_planners_gate(tmp_path, monkeypatch):
    import optuna

    for key, value in _env().items():
        monkeypatch.setenv(key, value)
    space = {HF_EMBD: {"choices": [32, 1024]}, "model.init_args.lr": {"low": 1e-3, "high": 1e-2, "log": True},
             "trainer.strategy": {"choices": ["bigtrain_zero1", "bigtrain_zero2"]}}  # fmt: skip
    tuner = Tuner(_hf_base(), space, trials=3, output=tmp_path / "s", seed=0, pruner=None, device_memory="64MB")
    for embd, strategy in ((1024, "bigtrain_zero2"), (32, "bigtrain_zero1"), (32, "bigtrain_zero2")):
        tuner.study.enqueue_trial({HF_EMBD: embd, "trainer.strategy": strategy})
    tuner.run()
    trials = tuner.study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.PRUNED] + [optuna.trial.TrialState.COMPLETE] * 2
    assert trials[0].user_attrs["bigtrain:status"] == "infeasible"
    assert [t.user_attrs["bigtrain:planned"] for t in trials] == ["zero2", "zero1", "zero2"]
    for t in trials[1:]:
        result = json.loads((Path(t.user_attrs["bigtrain:dir"]) / "result.json").read_text())
        assert result["status"] == "complete" and result["steps"] == 12 and 0 < t.values[0] < 5


# -- a real study: pruning on 2 ranks -------------------------------------------------------------------------------


@pytest.mark.integration
def test_pruned_trial_stops_on_both_ranks_at_the_same_step(tmp_path):
    import optuna

    base = _base(devices=2)
    base["trainer"]["limit_train_batches"] = 30
    # Reports every 256 samples: 2 ranks x batch 32 = 64 a step, so at step 4, as Optuna step 256.
    path = _write_tune(tmp_path, base, trials=1, pruning={"pruner": {"name": "threshold", "upper": 1.0},
                                                          "report_every": 256, "report_unit": "samples"})  # fmt: skip
    run = subprocess.run([BIGTRAIN, "tune", "--config", str(path)], cwd=tmp_path, env=_env(), capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    tuner = Tuner.from_yaml(path)
    (trial,) = tuner.study.get_trials()
    assert trial.state == optuna.trial.TrialState.PRUNED and trial.user_attrs["bigtrain:status"] == "pruned"
    result = json.loads((Path(trial.user_attrs["bigtrain:dir"]) / "result.json").read_text())
    assert result["world_size"] == 2
    # The untrained CNN's loss is ~2.3 > 1.0: the first report (step 4) prunes, and both ranks stop there.
    assert result["pruned_at_step"] == 4 and result["stopped_at_step_per_rank"] == [4, 4]
    assert list(trial.intermediate_values) == [256] and trial.intermediate_values[256] > 1.0
    assert "pruned" in run.stdout


# -- a killed study continues; two workers share one storage --------------------------------------------------------


def start_slow_study(tmp_path: Path, *extra: str) -> tuple[Path, list[str], subprocess.Popen, Path]:
    """A one-trial study (48 slowed steps, a checkpoint every 5) started as `bigtrain tune` (with ``extra``
    arguments) and followed until its trial's first checkpoint. Returns the tune config's path, the command, the
    running driver and the checkpoint."""
    base = _base()
    base["trainer"]["max_epochs"] = 3  # 16 batches each
    base["trainer"]["limit_train_batches"] = None
    base["trainer"]["callbacks"] = [{"class_path": "tests.helpers.tune.SlowSteps", "init_args": {"seconds": 0.15}}]
    path = _write_tune(tmp_path, base, trials=1, checkpoint_every_n_steps=5, pruning={"report_every": 5})
    cmd = [BIGTRAIN, "tune", "--config", str(path)]
    driver = subprocess.Popen([*cmd, *extra], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)  # fmt: skip
    ckpt = tmp_path / "study" / "trial_0000" / "checkpoints" / "last.ckpt"
    deadline = time.monotonic() + 300
    while not ckpt.exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ckpt.exists(), (driver.stdout.read() if driver.stdout else b"")[-3000:]
    return path, cmd, driver, ckpt


def kill_study_mid_trial(tmp_path: Path) -> tuple[Path, list[str]]:
    """:func:`start_slow_study`, then its driver and trial SIGKILLed, as when a node is lost: the trial is left
    RUNNING in the study. Returns the tune config's path and the command that runs it."""
    path, cmd, driver, ckpt = start_slow_study(tmp_path)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    os.killpg(json.loads((ckpt.parent.parent / "owner.json").read_text())["pgid"], signal.SIGKILL)
    assert not (tmp_path / "study" / "trial_0000" / "result.json").exists()
    return path, cmd


@pytest.mark.integration
def test_killed_study_continues_from_the_trials_checkpoint(tmp_path):
    import optuna

    path, cmd = kill_study_mid_trial(tmp_path)
    run = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "adopting trial 0" in run.stdout
    (trial,) = Tuner.from_yaml(path).study.get_trials()
    assert trial.state == optuna.trial.TrialState.COMPLETE and trial.user_attrs["bigtrain:launches"] == 2
    folder = Path(trial.user_attrs["bigtrain:dir"])
    assert json.loads((folder / "result.json").read_text())["steps"] == 48
    assert "Restoring states from the checkpoint path" in (folder / "log.txt").read_text()
    # Reported every 5 steps by both launches (the median pruner waits for 5 complete trials: nothing pruned).
    assert sorted(trial.intermediate_values) == list(range(5, 48, 5))


@pytest.mark.integration
def test_two_workers_share_one_study(tmp_path):
    import optuna

    # Multi-objective (NSGA-II), so no pruner: the measured step time against validation loss.
    path = _write_tune(tmp_path, _base(), trials=4, objectives={"val_loss": "minimize", "step_time": "minimize"})
    cmd = [BIGTRAIN, "tune", "--config", str(path)]
    workers = [subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for _ in range(2)]  # fmt: skip
    outs = [w.communicate(timeout=600)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), outs[0][-2000:] + outs[1][-2000:]
    tuner = Tuner.from_yaml(path)
    trials = tuner.study.get_trials()
    assert len(trials) == 4 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert all(t.user_attrs["bigtrain:launches"] == 1 for t in trials)
    launched = [[n for n in range(4) if f"trial {n} launched" in out] for out in outs]
    assert all(launched) and sorted(launched[0] + launched[1]) == [0, 1, 2, 3]
    assert all(len(t.values) == 2 and t.values[1] > 0 for t in trials)
    front = {t.number for t in tuner.study.best_trials}
    assert {r["number"] for r in tuner.records() if r["best"]} == front
    best = tuner.write_best_configs()
    assert len(best) == len(front) >= 1
    config = yaml.safe_load(best[0].read_text())
    assert "callbacks" not in config["trainer"]  # a plain fit config: no tuning parts
    check = subprocess.run([BIGTRAIN, "fit", "--config", str(best[0]), "--print_config"], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert check.returncode == 0, check.stderr[-2000:]
    assert tuner.pareto_plot() is not None and (tmp_path / "study" / "pareto.png").stat().st_size > 0


@pytest.mark.integration
def test_the_driver_stops_when_every_trial_fails_the_same_way(tmp_path, monkeypatch):
    import optuna

    from lightning_bigtrain.tune import TrialsFailingError

    base = _base()
    base["data"]["init_args"]["data_dir"] = str(tmp_path / "no-data-here")
    tuner = Tuner(base, {"model.init_args.lr": {"low": 1e-3, "high": 1e-2}}, trials=6, output=tmp_path / "s",
                  pruner=None, max_failures_in_a_row=2)  # fmt: skip
    for key, value in _env().items():
        monkeypatch.setenv(key, value)
    with pytest.raises(TrialsFailingError, match=r"2 trials in a row failed.*not set up"):
        tuner.run()
    trials = tuner.study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.FAIL] * 2  # not all six spent on it
    assert "not set up" in trials[0].user_attrs["bigtrain:reason"]


def test_each_strategy_spelling_maps_to_its_planner_row():
    from lightning_bigtrain.planning import COMPRESSED_STRATEGIES, STRATEGIES
    from lightning_bigtrain.tune.tuner import _plan_row, _Unplannable

    rows = dict.fromkeys([*STRATEGIES, *COMPRESSED_STRATEGIES])
    assert _plan_row("auto", rows) == _plan_row("ddp", rows) == "ddp"
    assert _plan_row("bigtrain_zero3_offload", rows) == "zero3_offload"
    assert _plan_row("bigtrain_ddp_powersgd", rows) == "ddp_powersgd"
    zero = {"class_path": "lightning_bigtrain.strategies.ZeroStrategy", "init_args": {"stage": 2}}
    assert _plan_row(zero, rows) == "zero2"
    rows.update(dict.fromkeys(["zero3_tp2", "zero3_tp4"]))
    assert _plan_row("bigtrain_zero3_tp2", rows) == "zero3_tp2"
    tp4 = {"class_path": "lightning_bigtrain.strategies.ZeroStrategy", "init_args": {"stage": 3, "tensor_parallel": 4}}
    assert _plan_row(tp4, rows) == "zero3_tp4"
    rows.update(dict.fromkeys(["zero3_pp2"]))
    assert _plan_row("bigtrain_zero3_pp2", rows) == "zero3_pp2"
    pp2 = {"class_path": "lightning_bigtrain.strategies.ZeroStrategy", "init_args": {"pipeline_parallel": 2}}
    assert _plan_row(pp2, rows) == "zero3_pp2"
    both = {"class_path": "lightning_bigtrain.strategies.ZeroStrategy",
            "init_args": {"pipeline_parallel": 2, "tensor_parallel": 2}}  # fmt: skip
    with pytest.raises(_Unplannable, match="tensor and pipeline parallelism together"):
        _plan_row(both, rows)
    zero1_tp2 = {"class_path": "lightning_bigtrain.strategies.ZeroStrategy",
                 "init_args": {"stage": 1, "tensor_parallel": 2}}  # fmt: skip
    rows.update(dict.fromkeys(["zero1_tp2", "zero3_tp2_sp"]))
    assert _plan_row(zero1_tp2, rows) == "zero1_tp2"
    sp = {"class_path": "lightning_bigtrain.strategies.ZeroStrategy",
          "init_args": {"tensor_parallel": 2, "sequence_parallel": True}}  # fmt: skip
    assert _plan_row(sp, rows) == "zero3_tp2_sp"
    sp1 = {"class_path": "lightning_bigtrain.strategies.ZeroStrategy",
           "init_args": {"stage": 1, "tensor_parallel": 2, "sequence_parallel": True}}  # fmt: skip
    rows.update(dict.fromkeys(["zero1_tp2_sp"]))
    assert _plan_row(sp1, rows) == "zero1_tp2_sp"
    zero1_pp2 = {"class_path": "lightning_bigtrain.strategies.ZeroStrategy",
                 "init_args": {"stage": 1, "pipeline_parallel": 2}}  # fmt: skip
    assert _plan_row(zero1_pp2, rows) == "zero3_pp2"  # one pipeline per group: the stages are one row
    rows.update(dict.fromkeys(["zero1_pp2"]))
    assert _plan_row(zero1_pp2, rows) == "zero1_pp2"  # pipelines across data-parallel replicas
    with pytest.raises(_Unplannable, match="no row for strategy 'fsdp'"):
        _plan_row("fsdp", rows)


def test_pareto_front_of_two_directions():
    from lightning_bigtrain.tune.tuner import _front

    points = [(1.0, 0.5), (2.0, 0.9), (3.0, 0.8), (1.5, 0.4)]  # (step time: minimize, accuracy: maximize)
    assert _front(points, (False, True)) == {0, 1}
    assert _front(points, (False, False)) == {0, 3}
