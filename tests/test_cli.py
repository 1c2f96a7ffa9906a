"""The `bigtrain` command: a real 2-rank fit from configs/demo.yaml, and clear errors for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
BIGTRAIN = str(Path(sys.executable).with_name("bigtrain"))


def _bigtrain(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "BIGTRAIN_DATA": os.environ.get("BIGTRAIN_DATA", str(ROOT / "data"))}
    return subprocess.run([BIGTRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _main(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run `bigtrain *args` in this process (argument errors need no process start-up): exit code, stdout, stderr.

    An exception other than the command's own exit propagates and fails the test: the in-process version of
    "no traceback for bad input"."""
    from lightning_bigtrain.cli import main

    code: int | str | None = 0
    try:
        main(list(args))
    except SystemExit as exit_info:
        code = exit_info.code
    out = capsys.readouterr()
    if isinstance(code, str):  # sys.exit("message"): printed to stderr, exit status 1
        return 1, out.out, out.err + code
    return int(code or 0), out.out, out.err


@pytest.mark.integration
def test_fit_demo_config_for_10_steps_on_two_ranks(tmp_path):
    shutil.copy(ROOT / "configs" / "demo.yaml", tmp_path / "demo.yaml")
    run = _bigtrain("fit", "--config", "demo.yaml", "--trainer.max_steps=10", "--trainer.val_check_interval=10",
                    "--trainer.limit_val_batches=2", cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "runs" / "cli-demo" / "report.json").read_text())
    assert report["steps"] == 10 and report["world_size"] == 2 and report["strategy"] == "DDPStrategy"
    assert report["train_loss_end"] < report["train_loss_start"]


# `bigtrain fit` configs; those with a top-level `base:` are `bigtrain tune` configs (tests/tune/test_tune.py).
FIT_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml") if "base" not in yaml.safe_load(p.read_text()))


@pytest.mark.parametrize("config", FIT_CONFIGS)
def test_every_config_parses(config, capsys, monkeypatch):
    """In this process (the command's own start-up is covered above): `bigtrain fit --config ... --print_config`."""
    from lightning_bigtrain.cli import main

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs" / config), "--print_config"])
    assert exit_info.value.code in (0, None), capsys.readouterr().err[-3000:]
    assert yaml.safe_load(capsys.readouterr().out)["model"]["class_path"].startswith("lightning_bigtrain.models.")


def test_config_typo_is_named(tmp_path, capsys, monkeypatch):
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config["trainer"]["max_stepz"] = config["trainer"].pop("max_steps")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    code, _, err = _main("fit", "--config", "bad.yaml", capsys=capsys)
    assert code != 0
    assert "max_stepz" in err


def test_unknown_strategy_name_gets_a_suggestion(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _main(
        "fit", "--config", str(ROOT / "configs" / "demo.yaml"), "--trainer.strategy=dpp", capsys=capsys
    )
    assert code != 0
    assert "`trainer.strategy='dpp'` is not a known strategy name. Did you mean 'ddp'" in err


def test_missing_data_names_make_data(tmp_path):
    env_run = subprocess.run(
        [BIGTRAIN, "fit", "--config", str(ROOT / "configs" / "demo.yaml"), "--trainer.max_steps=1"],
        cwd=tmp_path, env={**os.environ, "BIGTRAIN_DATA": str(tmp_path / "nodata")},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert env_run.returncode != 0
    assert "Shakespeare is not set up" in env_run.stderr and "make data" in env_run.stderr
    assert "Traceback" not in env_run.stderr


def test_demo_rejects_bad_steps(tmp_path, capsys):
    code, _, err = _main("demo", "--max-steps", "0", "--output", str(tmp_path), capsys=capsys)
    assert code != 0 and "max-steps must be >= 1" in err


@pytest.mark.integration
def test_demo_runs_and_writes_its_report(tmp_path):
    run = _bigtrain("demo", "--max-steps", "12", "--val-batches", "4", "--output", str(tmp_path / "demo"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    text = (tmp_path / "demo" / "report.md").read_text()
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert report["world_size"] == 2 and report["steps"] == 12 and report["tokens_per_s"] > 0
    assert report["val_loss_end"] < report["val_loss_start"]
    assert len(report["peak_memory_bytes_per_rank"]) == 2
    assert "tokens/s" in text and text.strip() in run.stdout
    # The saved model (a sharded ZeRO-2 folder) is the teacher of a distilled student.
    student = tmp_path / "student"
    run = _bigtrain("demo", "--max-steps", "10", "--val-batches", "2", "--teacher",
                    str(tmp_path / "demo" / "model.ckpt"), "--output", str(student), cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((student / "report.json").read_text())
    assert "KnowledgeDistillation" in report["callbacks"] and report["steps"] == 10
    metrics = next((student / "logs").rglob("metrics.csv")).read_text()
    assert "distill/kd_loss" in metrics.splitlines()[0]


@pytest.mark.integration
def test_demo_with_compression_and_pruning_logs_the_compression_ratio_and_sparsity(tmp_path):
    out = tmp_path / "demo"
    run = _bigtrain("demo", "--max-steps", "10", "--val-batches", "4", "--strategy", "bigtrain_zero1",
                    "--compression", "powersgd", "--prune", "0.5", "--output", str(out), cwd=tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["strategy"].startswith("ZeroStrategy(stage=1, compression=PowerSGD(rank=4")
    metrics = next((out / "logs").rglob("metrics.csv")).read_text()
    header, *lines = metrics.splitlines()
    column = header.split(",").index("compression/ratio")
    ratios = [float(line.split(",")[column]) for line in lines if line.split(",")[column]]
    assert ratios and min(ratios) > 10  # PowerSGD rank 4 on this GPT: about 20x fewer gradient bytes
    # Pruning alongside: the per-layer table ends with the total at the target sparsity.
    assert "MagnitudePruning" in report["callbacks"]
    total = next(line for line in (run.stdout + run.stderr).splitlines() if line.startswith("total "))
    assert total.split()[-1] == "50.00%"
    assert next((out / "logs").rglob("sparsity.png")).stat().st_size > 0


def test_demo_rejects_pruning_channels_under_zero(tmp_path, capsys):
    code, _, err = _main("demo", "--prune-channels", "0.5", "--output", str(tmp_path), capsys=capsys)
    assert code == 2 and "--prune-channels needs --strategy ddp" in err


def test_demo_rejects_a_compressor_stage_2_cannot_carry(tmp_path, capsys):
    code, _, err = _main("demo", "--compression", "topk", "--output", str(tmp_path), capsys=capsys)
    assert code == 2 and "needs --strategy ddp or bigtrain_zero1" in err


def test_consolidate_rejects_a_file(tmp_path, capsys):
    (tmp_path / "model.ckpt").write_bytes(b"")
    code, _, err = _main("consolidate", str(tmp_path / "model.ckpt"), str(tmp_path / "out.ckpt"), capsys=capsys)
    assert code != 0 and "expected the folder of a sharded checkpoint" in err


def test_plan_prints_a_table_and_writes_a_config_bigtrain_fit_reads(tmp_path):
    run = _bigtrain("plan", "--config", str(ROOT / "configs" / "zero3.yaml"), "--devices", "8", "--num-nodes", "4",
                    "--device-memory", "80GB", "--inter-node-bandwidth", "25Gbps", "--output", str(tmp_path),
                    cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "zero3_offload" in run.stdout and "<- recommended" in run.stdout
    config = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert config["trainer"]["devices"] == 8 and config["trainer"]["num_nodes"] == 4
    assert (tmp_path / "memory.png").stat().st_size > 0
    check = _bigtrain("fit", "--config", str(tmp_path / "plan.yaml"), "--print_config", cwd=ROOT)
    assert check.returncode == 0, check.stderr


def test_plan_rejects_unknown_units(tmp_path, capsys):
    code, _, err = _main("plan", "--config", str(ROOT / "configs" / "zero3.yaml"), "--devices", "8",
                         "--device-memory", "80 GBB", "--output", str(tmp_path), capsys=capsys)  # fmt: skip
    assert code == 2 and "`device_memory='80 GBB'`: not a size" in err


def test_a_plan_with_activation_checkpointing_writes_a_config_that_asks_for_it(tmp_path, capsys, monkeypatch):
    """`bigtrain plan --activation-checkpointing` wrote `strategy: bigtrain_zero3`: a run without what it counted.
    The block classes parse from a config by import path."""
    monkeypatch.chdir(ROOT)
    code, _, err = _main("plan", "--config", str(ROOT / "configs" / "zero3.yaml"), "--devices", "8",
                         "--device-memory", "80GB", "--activation-checkpointing", "--output", str(tmp_path),
                         capsys=capsys)  # fmt: skip
    assert code == 0, err
    strategy = yaml.safe_load((tmp_path / "plan.yaml").read_text())["trainer"]["strategy"]
    assert strategy["init_args"]["activation_checkpointing"] is True, strategy
    code, out, err = _main("fit", "--config", str(tmp_path / "plan.yaml"), "--print_config", capsys=capsys)
    assert code == 0, err
    assert yaml.safe_load(out)["trainer"]["strategy"]["init_args"]["activation_checkpointing"] is True
    code, out, err = _main("fit", "--config", str(ROOT / "configs" / "zero3.yaml"), "--print_config",
                           "--trainer.strategy.init_args.activation_checkpointing=lightning_bigtrain.models.gpt.Block",
                           capsys=capsys)  # fmt: skip
    assert code == 0, err
    assert "activation_checkpointing: lightning_bigtrain.models.gpt.Block" in out


def test_resume_auto_picks_the_newest_committed_last_checkpoint(tmp_path):
    import os

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_bigtrain.checkpointing import AtomicCheckpointIO
    from lightning_bigtrain.cli import resume_path

    def trainer(dirpath):
        return L.Trainer(logger=False, callbacks=[ModelCheckpoint(dirpath=dirpath)], accelerator="cpu")

    assert resume_path(L.Trainer(logger=False, accelerator="cpu")) == "last"  # folder known only once fitting
    assert resume_path(trainer(tmp_path)) is None  # nothing yet: a fresh start
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 2}, str(tmp_path / "epoch=0-step=2.ckpt"))
    assert resume_path(trainer(tmp_path)) == str(tmp_path / "epoch=0-step=2.ckpt")
    io.save_checkpoint({"step": 4}, str(tmp_path / "last.ckpt"))
    io.save_checkpoint({"step": 6}, str(tmp_path / "epoch=1-step=6.ckpt"))
    os.utime(tmp_path / "last.ckpt")  # newest by time, and named last: preferred
    assert resume_path(trainer(tmp_path)) == str(tmp_path / "last.ckpt")
    (tmp_path / "last.ckpt").write_bytes(b"")  # damaged: skipped
    assert resume_path(trainer(tmp_path)) == str(tmp_path / "epoch=1-step=6.ckpt")
    assert torch.load(resume_path(trainer(tmp_path)))["step"] == 6


def test_resume_auto_without_a_dirpath_finds_the_newest_version_holding_a_checkpoint(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_bigtrain.checkpointing import AtomicCheckpointIO
    from lightning_bigtrain.cli import resume_path

    def trainer(*loggers):
        return L.Trainer(logger=list(loggers), callbacks=[ModelCheckpoint()], accelerator="cpu")

    csv, tb = tmp_path / "csv" / "lightning_logs", tmp_path / "tb" / "lightning_logs"
    first = trainer(CSVLogger(tmp_path / "csv"))
    assert resume_path(first) is None and first.loggers[0]._version is None  # no version folder: a fresh start
    io = AtomicCheckpointIO()
    io.save_checkpoint({"step": 4}, str(csv / "version_0" / "checkpoints" / "last.ckpt"))
    io.save_checkpoint({"step": 2}, str(csv / "version_1" / "checkpoints" / "last.ckpt"))
    (csv / "version_2" / "checkpoints").mkdir(parents=True)  # a launch killed before its first checkpoint
    (csv / "version_3").mkdir()
    for version in range(4):
        (tb / f"version_{version}").mkdir(parents=True)
    resumed = trainer(CSVLogger(tmp_path / "csv"), TensorBoardLogger(tmp_path / "tb"))
    assert resume_path(resumed) == str(csv / "version_1" / "checkpoints" / "last.ckpt")
    assert [logger.version for logger in resumed.loggers] == [1, 1]  # both continue the launch's folders
    fixed = trainer(CSVLogger(tmp_path / "csv", version=0))
    assert resume_path(fixed) == str(csv / "version_0" / "checkpoints" / "last.ckpt")
    assert resume_path(trainer(TensorBoardLogger(tmp_path / "tb"))) is None  # its version folders hold none


_RESUMABLE = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  strategy:
    class_path: lightning_bigtrain.strategies.ZeroStrategy
    init_args:
      stage: 1
  max_steps: 8
  log_every_n_steps: 1
  limit_val_batches: 0
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args:
      save_dir: {root}
      flush_logs_every_n_steps: 1
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        every_n_train_steps: 2
        save_last: true
model:
  class_path: lightning_bigtrain.models.FashionCNN
  init_args:
    channels: [4, 8]
data:
  class_path: lightning_bigtrain.data.FashionMNISTDataModule
  init_args:
    batch_size: 16
    subset: 96
"""


class _Killed(Exception):
    pass


class KillAt(L.Callback):
    """Kills the fit (raises) at the start of the batch of optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise _Killed


@pytest.mark.usefixtures("in_process_fit")
def test_resume_auto_without_a_checkpoint_folder_continues_the_newest_version_and_its_log(tmp_path, capsys):
    """The defaults: ModelCheckpoint without a dirpath keeps its checkpoints in the logger's version folder, which
    Lightning makes new at every launch. `--resume auto` finds the newest version holding a checkpoint, continues
    it (no version_1), and its metrics.csv ends as the uninterrupted run's: the rows the stopped run logged after
    its last checkpoint (step 5 after the one at step 4) are the resumed run's."""
    import csv

    def fit(root: Path, *args: str) -> None:
        (root / "config.yaml").parent.mkdir(parents=True, exist_ok=True)
        (root / "config.yaml").write_text(_RESUMABLE.format(root=root / "logs"))
        code, _, err = _main("fit", "--config", str(root / "config.yaml"), *args, capsys=capsys)
        assert code == 0, err[-3000:]

    def rows(root: Path) -> list[dict[str, str]]:  # less ZeroStrategy's memory report, which each fit logs once
        with open(root / "logs" / "lightning_logs" / "version_0" / "metrics.csv", newline="") as f:
            return [row for row in csv.DictReader(f) if not row.get("zero/rank0_params_bytes")]

    fit(tmp_path / "ref")
    with pytest.raises(_Killed):  # one step after its checkpoint at step 4
        fit(tmp_path / "run", "--resume=auto", "--trainer.callbacks+=tests.test_cli.KillAt",
            "--trainer.callbacks.step=5")  # fmt: skip
    assert [r["step"] for r in rows(tmp_path / "run") if r["train_loss"]] == ["0", "1", "2", "3", "4"]
    fit(tmp_path / "run", "--resume=auto")
    assert sorted(p.name for p in (tmp_path / "run" / "logs" / "lightning_logs").iterdir()) == ["version_0"]
    assert rows(tmp_path / "run") == rows(tmp_path / "ref")
