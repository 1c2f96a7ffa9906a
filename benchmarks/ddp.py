"""Baseline: one process vs Lightning DDP on 2 CPU ranks (gloo), for the CNN and the char-GPT.

    python -m benchmarks.ddp [--quick] [--repeats N] [--results-dir DIR]

Weak scaling: every rank trains on the same per-rank batch, so DDP moves twice the samples per step.
The single process uses all cores (torch's default thread count); each DDP rank gets cores / 2 threads
(Lightning's default on CPU). Reported: samples/s over both ranks (median of repeats), the ratio
DDP / single, and peak RSS per rank. Later benchmarks compare their strategies against these figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    alternate,
    command_line,
    print_table,
    ratio,
    run_worker,
    summarize,
    write_results,
)

MODELS = ("cnn", "gpt")


def _build(model: str):
    from lightning_bigtrain.data import FashionMNISTDataModule, ShakespeareDataModule
    from lightning_bigtrain.models import CharGPT, FashionCNN

    if model == "cnn":
        return FashionCNN(channels=(32, 64, 128)), FashionMNISTDataModule(batch_size=64)
    data = ShakespeareDataModule(block_size=128, batch_size=32)
    return CharGPT(vocab_size=data.vocab_size, block_size=128, n_layer=4, n_head=4, n_embd=128), data


def worker(model: str, devices: int, steps: int, out: str) -> None:
    """One measured fit; rank 0 writes the RunReport dictionary to ``out``."""
    import lightning as L

    from benchmarks.common import set_flush_denormal
    from lightning_bigtrain.callbacks import RunReport

    set_flush_denormal()
    L.seed_everything(0, verbose=False)
    module, data = _build(model)
    report = RunReport(warmup_steps=3, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[report],
    )
    trainer.fit(module, datamodule=data)
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps(report.report))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps, one repeat (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="models to measure")
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.model, args.devices, args.steps, args.out)
        return {}

    repeats = args.repeats or (1 if args.quick else 3)
    steps = {"cnn": 8 if args.quick else 60, "gpt": 6 if args.quick else 40}
    rows, figures = [], {}
    for model in args.models:

        def run(devices: int, model: str = model) -> dict[str, Any]:
            return run_worker("benchmarks.ddp", ["--worker", "--model", model, "--devices", str(devices),
                                                 "--steps", str(steps[model])])  # fmt: skip

        measured = alternate({"single": lambda: run(1), "ddp2": lambda: run(2)}, repeats)
        single = summarize([r["samples_per_s"] for r in measured["single"]])
        ddp = summarize([r["samples_per_s"] for r in measured["ddp2"]])
        speedup = ratio(ddp["median"], single["median"])
        figures[model] = {
            "steps": steps[model],
            "single_samples_per_s": single,
            "ddp2_samples_per_s": ddp,
            "ddp2_over_single": speedup,
            "scaling_efficiency": speedup / 2,
            "single_peak_rss_mib": measured["single"][-1]["peak_memory_bytes_per_rank"][0] / 2**20,
            "ddp2_peak_rss_mib_per_rank": [b / 2**20 for b in measured["ddp2"][-1]["peak_memory_bytes_per_rank"]],
        }
        rows.append({
            "model": model,
            "single samples/s": single["median"],
            "DDP x2 samples/s": ddp["median"],
            "DDP / single": speedup,
            "efficiency": speedup / 2,
            "peak RSS/rank MiB (single, ddp)": f"{figures[model]['single_peak_rss_mib']:.0f}, "
            f"{max(figures[model]['ddp2_peak_rss_mib_per_rank']):.0f}",
        })  # fmt: skip
    print(f"\nDDP on 2 CPU ranks vs one process ({repeats} repeats, medians)")
    table = print_table(rows, list(rows[0]))
    headline = ", ".join(f"{m}: DDP x2 / single = {figures[m]['ddp2_over_single']:.2f}" for m in args.models)
    payload = {"config": {"repeats": repeats, "quick": args.quick, "steps": steps}, "figures": figures,
               "table": table}  # fmt: skip
    path = write_results("ddp", payload, headline, args.results_dir, command=command_line("benchmarks.ddp", argv))
    print(f"wrote {path}")
    return figures


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``ddp`` figure block (docs/zero.md), from ``results/ddp.json`` only: per model, samples/s of one
    process and of DDP on 2 ranks (medians, with the number of repeats), their ratio, the scaling efficiency
    and peak RSS."""
    from benchmarks.common import load_results, measured_line, sig, times

    results = load_results(results_dir, "ddp.json")
    lines = [
        measured_line(results, "ddp.json", results_dir),
        "",
        "Weak scaling: each DDP rank trains on the one process's batch; samples/s over all ranks, medians.",
        "",
        "| model | steps | one process, samples/s | DDP, samples/s (ranks) | DDP / one process | scaling efficiency "
        "| peak RSS MiB: one process / max per DDP rank | repeats |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, f in results["figures"].items():
        single, ddp = f["single_samples_per_s"], f["ddp2_samples_per_s"]
        ranks = len(f["ddp2_peak_rss_mib_per_rank"])
        lines.append(
            f"| {model} | {f['steps']} | {sig(single['median'])} | {sig(ddp['median'])} ({ranks}) "
            f"| {times(f['ddp2_over_single'])} | {sig(f['scaling_efficiency'])} "
            f"| {sig(f['single_peak_rss_mib'])} / {sig(max(f['ddp2_peak_rss_mib_per_rank']))} "
            f"| {single['n']} / {ddp['n']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
