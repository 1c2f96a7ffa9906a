"""``bigtrain tune`` on the Fashion-MNIST CNN: a 20-trial study from ``configs/tune.yaml``, then its best
configuration against the defaults of ``configs/fashion_cnn.yaml``, same budget, 3 seeds each.

    python -m benchmarks.tune [--trials 20] [--seeds 3] [--quick]
    python -m benchmarks.tune --gpt      # the char-GPT study of configs/tune_gpt.yaml (the study only)

1. The study: ``bigtrain tune --config configs/tune.yaml --trials 20`` in a fresh folder, its wall time on this
   machine (2 CPU cores; each trial a 2-rank fit of one epoch), the trials by outcome (complete, pruned by the
   step-level pruner, refused by the planner, failed), the table of every trial and the plot of validation
   accuracy against step time with the Pareto front.
2. The check: the best trial's values written into ``configs/fashion_cnn.yaml`` (at that file's own budget, 2
   epochs) against that file unchanged, each run as ``bigtrain fit`` on 2 ranks with seeds 0..2, alternating
   which goes first; validation accuracy at the end of training (the split the study optimized: 5000 training
   images held out), and the test split's for reference is not used by the study.

Targets (issue 23): 20 trials in at most 45 minutes here, at least 30% of them pruned early, the best
configuration's mean validation accuracy above the defaults'.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from benchmarks.common import RESULTS_DIR, command_line, machine_info, print_table, write_results

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tune.yaml"
GPT_CONFIG = ROOT / "configs" / "tune_gpt.yaml"
PLOT = "tune_pareto.png"
GPT_PLOT = "tune_gpt_pareto.png"


def _quick_config(out: Path, config: Path) -> Path:
    """A tune config on a slice of the data (a smoke run of the benchmark, not a figure)."""
    raw = yaml.safe_load(config.read_text())
    raw["base"] = str((config.parent / raw["base"]).resolve())
    if config == GPT_CONFIG:
        raw["overrides"].update({"trainer.max_steps": 20, "trainer.val_check_interval": 20,
                                 "trainer.limit_val_batches": 2})  # fmt: skip
    else:
        raw["overrides"].update({"trainer.limit_train_batches": 20, "trainer.limit_val_batches": 4})
    raw["pruning"]["report_every"] = 640
    raw["pruning"]["pruner"]["n_warmup_steps"] = 640
    raw["pruning"]["pruner"]["n_startup_trials"] = 1
    path = out / "tune_quick.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _fit(config: dict[str, Any], folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "lightning_bigtrain.cli", "fit", "--config", str(folder / "config.yaml")]
    with open(folder / "log.txt", "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=3600).returncode
    result = folder / "result.json"
    if rc != 0 or not result.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed ({rc}): {(folder / 'log.txt').read_text()[-3000:]}")
    return json.loads(result.read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_bigtrain.tune import Tuner

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="3 trials and 1 seed on a slice of the data (smoke)")
    parser.add_argument("--gpt", action="store_true", help="the char-GPT study (configs/tune_gpt.yaml), study only")
    parser.add_argument("--output", type=Path, default=ROOT / "runs" / "bench-tune", help="scratch folder (emptied)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    trials = 3 if args.quick else args.trials
    seeds = list(range(1 if args.quick else args.seeds))
    out = args.output.resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    source = GPT_CONFIG if args.gpt else CONFIG
    config = _quick_config(out, source) if args.quick else source
    study_dir = out / "study"
    env_note = os.environ.get("BIGTRAIN_DATA", "")

    # 1. the study, as a user runs it
    cmd = [sys.executable, "-m", "lightning_bigtrain.cli", "tune", "--config", str(config), "--trials", str(trials),
           "--output", str(study_dir)]  # fmt: skip
    t0 = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * 3600)
    study_seconds = time.perf_counter() - t0
    (out / "study.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0:
        raise RuntimeError(f"the study failed ({run.returncode}): {run.stderr[-3000:]}")
    tuner = Tuner.from_yaml(config, output=str(study_dir))
    records = tuner.records()
    counts = tuner.summary()
    best = tuner.study.best_trial
    values = tuner.space.values_of(best.params)
    print(tuner.table())
    print(f"study: {trials} trials in {study_seconds / 60:.1f} min; {counts}", flush=True)
    pruned = counts.get("pruned", 0)
    study = {
        "trials": trials,
        "study_seconds": study_seconds,
        "counts": counts,
        "pruned_fraction": pruned / trials,
        "params": [p.path for p in tuner.space.parameters],
        "objectives": list(tuner.objectives),
        "records": records,
        "best_trial": best.number,
        "best_values": values,
        "best_study_value": best.value,
    }
    area = ("tune_gpt" if args.gpt else "tune") + ("_quick" if args.quick else "")

    def record(figures: dict[str, Any], plot_name: str, found: str, config: dict[str, Any]) -> dict[str, Any]:
        plot = tuner.pareto_plot(study_dir / "pareto.png")
        if plot is not None and not args.quick:
            shutil.copy(plot, args.results_dir / plot_name)
            figures["plot"] = plot_name
        headline = f"{trials} trials in {study_seconds / 60:.1f} min, {100 * pruned / trials:.0f}% pruned; {found}"
        payload = {"config": {"quick": args.quick, "trials": trials, **config}, "machine": machine_info(),
                   "figures": figures}  # fmt: skip
        path = write_results(area, payload, headline, args.results_dir, command=command_line("benchmarks.tune", argv))
        print(f"wrote {path}")
        return figures

    if args.gpt:  # the study alone: the comparison with a config's defaults is the CNN's
        return record(study, GPT_PLOT, f"best val loss {best.value:.4f}", {"tune_config": "configs/tune_gpt.yaml"})

    # 2. best against the defaults, at the defaults' budget, same seeds
    evals: dict[str, list[dict[str, Any]]] = {"best": [], "defaults": []}
    for seed in seeds:
        order = ("best", "defaults") if seed % 2 == 0 else ("defaults", "best")
        for which in order:
            folder = out / "eval" / f"{which}_seed{seed}"
            fit = tuner.trial_config(values if which == "best" else {}, folder, overrides=args.quick)
            fit["seed_everything"] = seed
            for cb in fit["trainer"]["callbacks"]:
                if cb["class_path"].endswith("TuneTrial"):
                    cb["init_args"]["objectives"] = ["val_acc", "val_loss"]
            r = _fit(fit, folder)
            evals[which].append(r)
            m = r["measures"]
            print(f"seed {seed} {which}: val acc {m['val_acc']:.4f}, val loss {m['val_loss']:.4f}, "
                  f"step {1e3 * m['step_time']:.1f} ms", flush=True)  # fmt: skip

    def summary(name: str) -> dict[str, Any]:
        accs = [r["measures"]["val_acc"] for r in evals[name]]
        losses = [r["measures"]["val_loss"] for r in evals[name]]
        steps = [r["measures"]["step_time"] for r in evals[name]]
        return {"val_acc": accs, "val_loss": losses, "step_time": steps, "mean_acc": statistics.fmean(accs),
                "mean_loss": statistics.fmean(losses), "mean_step_time": statistics.fmean(steps),
                "epochs": yaml.safe_load((out / "eval" / f"{name}_seed0" / "config.yaml").read_text())["trainer"].get(
                    "max_epochs")}  # fmt: skip

    b, d = summary("best"), summary("defaults")
    rows = [
        {"config": k, "val acc": v["mean_acc"], "min..max": f"{min(v['val_acc']):.4f}..{max(v['val_acc']):.4f}",
         "val loss": v["mean_loss"], "step ms": 1e3 * v["mean_step_time"]}
        for k, v in (("best", b), ("defaults", d))
    ]  # fmt: skip
    comparison = print_table(rows, list(rows[0]))
    figures = {
        **study,
        "launched": sum(v for k, v in counts.items() if k != "infeasible"),
        "seeds": seeds,
        "best": b,
        "defaults": d,
        "gain_points": 100 * (b["mean_acc"] - d["mean_acc"]),
        "comparison_table": comparison,
    }
    return record(
        figures,
        PLOT,
        f"best {100 * b['mean_acc']:.2f}% val acc vs defaults {100 * d['mean_acc']:.2f}%",
        {"seeds": seeds, "tune_config": "configs/tune.yaml", "data": "BIGTRAIN_DATA" if env_note else "data/"},
    )


def _fixed(value: Any) -> str:
    """A value in fixed-point notation, 3 significant digits (the same shape at any magnitude); text as it is."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or value == 0 or not math.isfinite(value):
        return str(value)
    return f"{value:.{max(0, 2 - math.floor(math.log10(abs(value))))}f}"


def render_gpt_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``tune-gpt`` block (docs/tune.md), from ``results/tune_gpt.json``."""
    from benchmarks.common import load_results, measured_line
    from lightning_bigtrain.tune.tuner import render_table

    results = load_results(results_dir, "tune_gpt.json")
    f = results["figures"]
    counts = ", ".join(f"{v} {k}" for k, v in sorted(f["counts"].items()))
    best = ", ".join(f"`{k.rsplit('.', 1)[-1]}={_fixed(v)}`" for k, v in f["best_values"].items())
    lines = [
        measured_line(results, "tune_gpt.json", results_dir),
        "",
        f"The char-GPT study (`bigtrain tune --config configs/tune_gpt.yaml`, {f['trials']} trials, each a 2-rank fit "
        f"of configs/demo.yaml at the `overrides:` of configs/tune_gpt.yaml): "
        f"**{f['study_seconds'] / 60:.1f} minutes** on this machine; {counts} "
        f"(**{100 * f['pruned_fraction']:.0f}% pruned** early). Best trial {f['best_trial']}, validation loss "
        f"{f['best_study_value']:.4f}: {best}.",
        "",
        render_table(f["records"], f["params"], f["objectives"], fmt=_fixed),
    ]
    if f.get("plot"):
        lines += ["", f"![validation loss against step time]({'../benchmarks/results/' + f['plot']})"]
    return "\n".join(lines)


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``tune`` block (docs/tune.md), from ``results/tune.json``."""
    from benchmarks.common import load_results, measured_line
    from lightning_bigtrain.tune.tuner import render_table

    results = load_results(results_dir, "tune.json")
    f = results["figures"]
    b, d = f["best"], f["defaults"]
    counts = ", ".join(f"{v} {k}" for k, v in sorted(f["counts"].items()))
    best = ", ".join(f"`{k.rsplit('.', 1)[-1]}={_fixed(v)}`" for k, v in f["best_values"].items())
    rows = [
        f"| {name} | {100 * v['mean_acc']:.2f}% | {100 * min(v['val_acc']):.2f}..{100 * max(v['val_acc']):.2f}% "
        f"| {v['mean_loss']:.4f} | {1e3 * v['mean_step_time']:.1f} |"
        for name, v in (("best trial's", b), ("defaults", d))
    ]
    lines = [
        measured_line(results, "tune.json", results_dir),
        "",
        f"The study (`bigtrain tune --config configs/tune.yaml`, {f['trials']} trials, each a 2-rank fit of one "
        f"epoch): **{f['study_seconds'] / 60:.1f} minutes** on this machine; {counts} "
        f"(**{100 * f['pruned_fraction']:.0f}% pruned** early by the median pruner on the training loss at equal "
        f"samples seen). Best trial {f['best_trial']}: {best}.",
        "",
        f"Its configuration against `configs/fashion_cnn.yaml` unchanged, both at that file's budget "
        f"({b['epochs']} epochs, 2 ranks), seeds {', '.join(map(str, f['seeds']))}: validation accuracy "
        f"**{100 * b['mean_acc']:.2f}%** against **{100 * d['mean_acc']:.2f}%** "
        f"({f['gain_points']:+.2f} pts; per seed {', '.join(f'{100 * v:.2f}' for v in b['val_acc'])} against "
        f"{', '.join(f'{100 * v:.2f}' for v in d['val_acc'])}).",
        "",
        "| configuration | val acc (mean) | min..max | val loss | step ms |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "Every trial of the study (accuracy after one epoch; `steps`: optimizer steps run):",
        "",
        render_table(f["records"], f["params"], f["objectives"], fmt=_fixed),
    ]
    if f.get("plot"):
        lines += ["", f"![validation accuracy against step time]({'../benchmarks/results/' + f['plot']})"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
