"""Memory you can see: peak RSS per rank of DDP and the ZeRO stages on a large model, next to their accounting.

    python -m benchmarks.zero_memory [--quick] [--configs ...] [--results-dir DIR]
    python -m benchmarks.zero_memory --fits 6GiB     # what fits: ~300M parameters under a per-process budget

A char-GPT of about 150M parameters (12 layers, width 1024; ``--quick``: 4 layers, width 512, about 13M) trained
for a few steps with AdamW on Shakespeare at world size 2 (CPU, gloo), under plain Lightning DDP (the peer) and
ZeroStrategy stages 1/2/3, in fp32 and in ``bf16-mixed``. Each configuration runs twice, in fresh processes: on
the large model, and on a tiny one (under 1M parameters) whose peak RSS is the runtime's own footprint (torch,
Lightning, gloo, the data) for that same strategy. The figure is the difference per parameter, next to what the
strategy's accounting says it holds (parameters, gradients and optimizer states per rank: ``model_state_bytes``,
taken at the second step), and the ratios between stages. What the rest is (optimizer temporaries, DDP's buckets,
the allocator's high-water mark) is in docs/zero.md. Rendered there by :func:`render_block`.

``--fits BUDGET`` asks what fits a per-process memory budget at about 300M parameters (24 layers, width 1024): for
DDP in fp32, ZeRO-3 in fp32 and ZeRO-2 in ``bf16-mixed``, the planner's peak for that model and batch plus the
runtime's footprint (measured on the tiny model, same strategy) is the prediction; only the configurations predicted
to fit are run, and their measured peak RSS per rank is compared with the budget and the prediction. Written to
``results/zero_fits.json`` and rendered by :func:`render_fits_block`.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, command_line, print_table, ratio, run_worker, write_results

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
PRECISIONS = ("32-true", "bf16-mixed")
CONFIGS = tuple(f"{s}@{p}" for p in PRECISIONS for s in STRATEGIES)
SIZES = {"large": (12, 1024), "quick": (4, 512), "tiny": (2, 64), "fits": (24, 1024)}  # (layers, width)
FITS_CONFIGS = ("ddp@32-true", "zero3@32-true", "zero2@bf16-mixed")
BLOCK_SIZE, BATCH_SIZE = 64, 2


def worker(config: str, size: str, steps: int, out: str) -> None:
    import lightning as L

    from benchmarks.common import set_flush_denormal
    from lightning_bigtrain.callbacks import RunReport
    from lightning_bigtrain.data import ShakespeareDataModule
    from lightning_bigtrain.strategies import ZeroStrategy

    name, precision = config.split("@")
    set_flush_denormal()
    L.seed_everything(0, verbose=False)
    data = ShakespeareDataModule(block_size=BLOCK_SIZE, batch_size=BATCH_SIZE, subset=4096)
    model = _model(data.vocab_size, size)
    psi = sum(p.numel() for p in model.parameters())
    strategy: Any = "ddp" if name == "ddp" else ZeroStrategy(stage=int(name[-1]))
    report = RunReport(warmup_steps=1, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_steps=steps,
                        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[report])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps({**report.report, "psi": psi, "size": size, "config": config}))


def _model(vocab_size: int, size: str) -> Any:
    from lightning_bigtrain.models import CharGPT

    layers, width = SIZES[size]
    return CharGPT(vocab_size=vocab_size, block_size=BLOCK_SIZE, n_layer=layers, n_head=8, n_embd=width)


def _predicted_peak(config: str, budget: int) -> tuple[int, float]:
    """The planner's per-process peak (model states, activations measured on the model, transients) for the
    ``fits`` model under ``config``, and its parameter count."""
    import torch

    from lightning_bigtrain.data import ShakespeareDataModule
    from lightning_bigtrain.planning import plan

    name, precision = config.split("@")
    data = ShakespeareDataModule(block_size=BLOCK_SIZE, batch_size=BATCH_SIZE, subset=4096)
    model = _model(data.vocab_size, "fits")
    psi = sum(p.numel() for p in model.parameters())
    rows = plan(model, devices=2, device_memory=budget, accelerator="cpu", batch_shape=(BATCH_SIZE, BLOCK_SIZE),
                input_dtype=torch.long, optimizer="adamw", precision=precision)  # fmt: skip
    return psi, rows[name].peak_bytes


def fits(budget_text: str, steps: int, results_dir: Path, argv: list[str] | None) -> dict[str, Any]:
    """Predict, then run what is predicted to fit ``budget_text`` per process (see the module docstring)."""
    from lightning_bigtrain.planning.planner import parse_bytes

    budget = parse_bytes(budget_text, "--fits")
    figures: dict[str, Any] = {}
    for config in FITS_CONFIGS:
        tiny = run_worker("benchmarks.zero_memory", ["--worker", config, "--size", "tiny", "--steps", str(steps)])
        footprint = max(tiny["peak_memory_bytes_per_rank"])
        psi, planner_peak = _predicted_peak(config, budget)
        predicted = planner_peak + footprint
        entry: dict[str, Any] = {"psi": psi, "footprint_bytes": footprint, "planner_peak_bytes": planner_peak,
                                 "predicted_bytes": predicted, "predicted_fits": predicted <= budget}  # fmt: skip
        if entry["predicted_fits"]:
            big = run_worker("benchmarks.zero_memory", ["--worker", config, "--size", "fits", "--steps", str(steps)])
            measured = max(big["peak_memory_bytes_per_rank"])
            entry.update(measured_peak_bytes=measured, measured_fits=measured <= budget,
                         measured_over_predicted=ratio(measured, predicted))  # fmt: skip
        figures[config] = entry
        print(f"{config}: predicted {predicted / 2**30:.2f} GiB per process, "
              + (f"measured {entry['measured_peak_bytes'] / 2**30:.2f} GiB" if "measured_peak_bytes" in entry
                 else "not run (predicted over the budget)"), flush=True)  # fmt: skip
    rows = [{"config": c, "predicted GiB": f["predicted_bytes"] / 2**30,
             "measured GiB": f["measured_peak_bytes"] / 2**30 if "measured_peak_bytes" in f else "not run",
             "fits": f.get("measured_fits", f["predicted_fits"])} for c, f in figures.items()]  # fmt: skip
    psi = next(iter(figures.values()))["psi"]
    print(f"\nWhat fits {budget / 2**30:.2f} GiB per process, char-GPT {psi / 1e6:.0f}M params, 2 CPU ranks")
    table = print_table(rows, list(rows[0]))
    headline = ", ".join(
        f"{c}: {'fits' if f.get('measured_fits') else 'predicted over' if not f['predicted_fits'] else 'over'}"
        for c, f in figures.items()
    )
    payload = {"config": {"size": "fits", "layers_width": SIZES["fits"], "steps": steps, "world_size": 2,
                          "budget_bytes": budget, "budget": budget_text, "batch": [BATCH_SIZE, BLOCK_SIZE]},
               "figures": figures, "table": table}  # fmt: skip
    path = write_results("zero_fits", payload, headline, results_dir,
                         command=command_line("benchmarks.zero_memory", argv))  # fmt: skip
    print(f"wrote {path}")
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fits", metavar="BUDGET", help="what fits this per-process budget at ~300M parameters")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="large", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.size, args.steps, args.out)
        return {}
    if args.fits:
        return fits(args.fits, args.steps, args.results_dir, argv)

    size = "quick" if args.quick else "large"

    def run(config: str, which: str) -> dict[str, Any]:
        return run_worker("benchmarks.zero_memory",
                          ["--worker", config, "--size", which, "--steps", str(args.steps)])  # fmt: skip

    figures: dict[str, Any] = {}
    for config in args.configs:
        tiny, big = run(config, "tiny"), run(config, size)
        psi = big["psi"]
        above = [b - t for b, t in zip(big["peak_memory_bytes_per_rank"], tiny["peak_memory_bytes_per_rank"],
                                       strict=True)]  # fmt: skip
        states = big["model_state_bytes_per_rank"]
        figures[config] = {
            "psi": psi,
            "tiny_psi": tiny["psi"],
            "footprint_bytes_per_rank": tiny["peak_memory_bytes_per_rank"],
            "peak_bytes_per_rank": big["peak_memory_bytes_per_rank"],
            "above_footprint_bytes_per_param": max(above) / psi,
            "accounting_bytes_per_param": max(states) / psi,
            "measured_over_accounting": ratio(max(above), max(states)),
        }
        print(f"{config}: {figures[config]['above_footprint_bytes_per_param']:.1f} B/param above the footprint, "
              f"accounting {figures[config]['accounting_bytes_per_param']:.1f}", flush=True)  # fmt: skip
    for config, f in figures.items():
        precision = config.split("@")[1]
        ddp = figures.get(f"ddp@{precision}")
        f["over_ddp"] = (
            ratio(f["above_footprint_bytes_per_param"], ddp["above_footprint_bytes_per_param"]) if ddp else None
        )
    rows = [{"config": c, "B/param above footprint": f["above_footprint_bytes_per_param"],
             "accounting B/param": f["accounting_bytes_per_param"],
             "measured / accounting": f["measured_over_accounting"],
             "/ DDP": f["over_ddp"] if f["over_ddp"] is not None else "-"} for c, f in figures.items()]  # fmt: skip
    psi = next(iter(figures.values()))["psi"]
    print(f"\nPeak RSS per rank above the runtime's footprint, char-GPT {psi / 1e6:.0f}M params, 2 CPU ranks")
    table = print_table(rows, list(rows[0]))
    headline = ", ".join(f"{c}: {f['above_footprint_bytes_per_param']:.1f} B/param" for c, f in figures.items())
    payload = {"config": {"size": size, "layers_width": SIZES[size], "steps": args.steps, "world_size": 2},
               "figures": figures, "table": table}  # fmt: skip
    path = write_results("zero_memory", payload, headline, args.results_dir,
                         command=command_line("benchmarks.zero_memory", argv))  # fmt: skip
    print(f"wrote {path}")
    return figures


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``zero-memory`` figure block (docs/zero.md), from ``results/zero_memory.json``: per strategy and precision,
    peak RSS per rank above the same strategy's footprint on a tiny model, per parameter, beside the accounting, and
    the ratio to DDP in the same precision."""
    from benchmarks.common import load_results, measured_line, sig, times

    results = load_results(results_dir, "zero_memory.json")
    f, cfg = results["figures"], results["config"]
    psi = next(iter(f.values()))["psi"]
    lines = [
        measured_line(results, "zero_memory.json", results_dir),
        "",
        f"Char-GPT of {sig(psi / 1e6)}M parameters, AdamW, 2 CPU ranks over gloo, {cfg['steps']} steps. Peak RSS per "
        "rank less the same strategy's peak on a tiny model (the runtime's footprint), per parameter; the "
        "accounting is the strategy's own count of parameters, gradients and optimizer states.",
        "",
        "| strategy | precision | peak RSS above footprint, bytes/param | accounting, bytes/param "
        "| measured / accounting | / DDP (same precision) |",
        "|---|---|---|---|---|---|",
    ]
    for config, r in f.items():
        name, precision = config.split("@")
        over = times(r["over_ddp"]) if r.get("over_ddp") is not None else "-"
        lines.append(
            f"| {name} | `{precision}` | {sig(r['above_footprint_bytes_per_param'])} "
            f"| {sig(r['accounting_bytes_per_param'])} | {times(r['measured_over_accounting'])} | {over} |"
        )
    return "\n".join(lines)


def render_fits_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``zero-fits`` figure block (docs/zero.md), from ``results/zero_fits.json``: per configuration, the
    planner's prediction per process (its peak plus the measured runtime footprint) against the budget, and the
    measured peak RSS of those predicted to fit."""
    from benchmarks.common import load_results, measured_line, sig, times

    results = load_results(results_dir, "zero_fits.json")
    f, cfg = results["figures"], results["config"]
    # The batch the run used; files written before it was recorded ran the module's constants then (e2e62c0).
    batch = "x".join(str(v) for v in cfg.get("batch", (BATCH_SIZE, BLOCK_SIZE)))
    psi = next(iter(f.values()))["psi"]
    gib = 2**30
    lines = [
        measured_line(results, "zero_fits.json", results_dir),
        "",
        f"Char-GPT of {sig(psi / 1e6)}M parameters, AdamW, batch {batch}, 2 CPU ranks over gloo, "
        f"{cfg['steps']} steps; budget {sig(cfg['budget_bytes'] / gib)} GiB per process. Predicted: the planner's "
        "peak for this model and batch plus the runtime's footprint (the same strategy's peak RSS on a tiny model); "
        "only configurations predicted to fit are run.",
        "",
        "| strategy | precision | predicted, GiB | predicted to fit | measured peak RSS, GiB | measured / predicted "
        "| fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for config, r in f.items():
        name, precision = config.split("@")
        ran = "measured_peak_bytes" in r
        lines.append(
            f"| {name} | `{precision}` | {sig(r['predicted_bytes'] / gib)} | {'yes' if r['predicted_fits'] else 'no'} "
            f"| {sig(r['measured_peak_bytes'] / gib) if ran else 'not run'} "
            f"| {times(r['measured_over_predicted']) if ran else '-'} "
            f"| {('yes' if r['measured_fits'] else 'no') if ran else '-'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
