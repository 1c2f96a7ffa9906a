"""Activation checkpointing: the memory it frees and the time it costs, against the same run without it.

    python -m benchmarks.activation_checkpointing [--quick] [--layouts zero3 ds3] [--results-dir DIR]

The ZeRO benchmarks' char-GPT (25M parameters, 8 layers, width 512; ``--quick``: 2 layers, width 128) on
Shakespeare at batch 8 of 256 characters per rank, world size 2 (CPU, gloo), fp32 AdamW, under
``ZeroStrategy(stage=3)`` and ``DeepSpeedZeroStrategy(3)``, each without and with ``activation_checkpointing=True``
(the peer of a checkpointed run is the same run keeping its activations). Each run is a fresh process pair
(``RunReport``): peak RSS per rank and samples/s after a warm-up step, medians over ``--repeats`` runs of each,
alternating the order. Beside them, the planner's activation bytes for
the same model and batch, without and with checkpointing (``plan(..., activation_checkpointing=...)``): what it
predicts the option saves, against the saving measured. Rendered into docs/zero.md by :func:`render_block`.
"""

from __future__ import annotations

import argparse
import json
import warnings
from functools import partial
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

LAYOUTS = ("zero3", "ds3")
BATCH, BLOCK = 8, 256


def _model(quick: bool) -> tuple[Any, Any]:
    import lightning as L

    from benchmarks.common import set_flush_denormal
    from lightning_bigtrain.data import ShakespeareDataModule
    from lightning_bigtrain.models import CharGPT

    set_flush_denormal()
    L.seed_everything(0, verbose=False)
    data = ShakespeareDataModule(block_size=BLOCK, batch_size=BATCH, subset=8192)
    width, layers = (128, 2) if quick else (512, 8)
    return data, CharGPT(vocab_size=data.vocab_size, block_size=BLOCK, n_layer=layers, n_head=8, n_embd=width)


def worker(layout: str, checkpointing: bool, quick: bool, steps: int, out: str) -> None:
    import lightning as L

    from lightning_bigtrain.callbacks import RunReport
    from lightning_bigtrain.strategies import DeepSpeedZeroStrategy, ZeroStrategy

    data, model = _model(quick)
    strategy: Any = (DeepSpeedZeroStrategy(3, activation_checkpointing=checkpointing) if layout == "ds3"
                     else ZeroStrategy(stage=3, activation_checkpointing=checkpointing))  # fmt: skip
    report = RunReport(warmup_steps=1, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[report])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        blocks = list(strategy.checkpointed_blocks)
        Path(out).write_text(json.dumps({**report.report, "checkpointed_blocks": blocks}))


def _planned(quick: bool) -> dict[str, float]:
    """The planner's activation bytes per rank for this model and batch, without and with checkpointing (zero3)."""
    import torch

    from lightning_bigtrain.planning import plan

    _, model = _model(quick)
    out = {}
    for checkpointing in (False, True):
        rows = plan(model, devices=2, accelerator="cpu", batch_shape=(BATCH, BLOCK), input_dtype=torch.long,
                    optimizer="adamw", activation_checkpointing=checkpointing, compression=False)  # fmt: skip
        out["checkpointed" if checkpointing else "plain"] = rows["zero3"].activation_bytes
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each configuration, alternating the order")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.checkpointing, args.quick, args.steps, args.out)
        return {}
    planned = _planned(args.quick)
    figures: dict[str, Any] = {}
    module = "benchmarks.activation_checkpointing"
    for layout in args.layouts:
        flags = ["--worker", layout, "--steps", str(args.steps)] + ["--quick"] * args.quick
        runs = alternate({"plain": partial(run_worker, module, flags),
                          "checkpointed": partial(run_worker, module, [*flags, "--checkpointing"])},
                         args.repeats)  # fmt: skip
        peaks = {k: summarize([max(r["peak_memory_bytes_per_rank"]) for r in v]) for k, v in runs.items()}
        speeds = {k: summarize([r["samples_per_s"] for r in v]) for k, v in runs.items()}
        peak_plain, peak_ckpt = peaks["plain"]["median"], peaks["checkpointed"]["median"]
        figures[layout] = {
            "peak_bytes_plain": peak_plain,
            "peak_bytes_checkpointed": peak_ckpt,
            "saved_bytes": peak_plain - peak_ckpt,
            "peak_ratio": ratio(peak_ckpt, peak_plain),
            "peak_bytes": peaks,
            "samples_per_s": speeds,
            "step_time_ratio": ratio(speeds["plain"]["median"], speeds["checkpointed"]["median"]),
            "loss_end": {k: [r["train_loss_end"] for r in v] for k, v in runs.items()},
            "checkpointed_blocks": runs["checkpointed"][0]["checkpointed_blocks"],
        }
        f = figures[layout]
        print(f"{layout}: peak RSS {peak_plain / 2**20:.0f} -> {peak_ckpt / 2**20:.0f} MiB per rank, "
              f"step time x{f['step_time_ratio']:.2f}", flush=True)  # fmt: skip
    rows = [{"layout": k, "peak MiB": f["peak_bytes_plain"] / 2**20, "checkpointed MiB": f["peak_bytes_checkpointed"]
             / 2**20, "saved MiB": f["saved_bytes"] / 2**20, "step time ratio": f["step_time_ratio"]}
            for k, f in figures.items()]  # fmt: skip
    print("\nActivation checkpointing, char-GPT at batch 8x256 per rank, 2 CPU ranks")
    table = print_table(rows, list(rows[0]))
    headline = ", ".join(f"{k}: peak x{f['peak_ratio']:.2f}, step time x{f['step_time_ratio']:.2f}"
                         for k, f in figures.items())  # fmt: skip
    payload = {"config": {"quick": args.quick, "steps": args.steps, "repeats": args.repeats, "world_size": 2,
                          "batch": [BATCH, BLOCK]},
               "planned_activation_bytes": planned, "figures": figures, "table": table}  # fmt: skip
    path = write_results("activation_checkpointing", payload, headline, args.results_dir,
                         command=command_line("benchmarks.activation_checkpointing", argv))  # fmt: skip
    print(f"wrote {path}")
    return figures


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``activation-checkpointing`` block (docs/zero.md), from ``results/activation_checkpointing.json``."""
    from benchmarks.common import load_results, measured_line, sig, times

    r = load_results(results_dir, "activation_checkpointing.json")
    planned = r["planned_activation_bytes"]
    lines = [measured_line(r, "activation_checkpointing.json", results_dir), "",
             "| layout | peak RSS per rank | with `activation_checkpointing=True` | freed | step time |",
             "|---|---|---|---|---|"]  # fmt: skip
    for layout, f in r["figures"].items():
        lines.append(f"| {layout} | {sig(f['peak_bytes_plain'] / 2**20)} MiB | "
                     f"{sig(f['peak_bytes_checkpointed'] / 2**20)} MiB | {sig(f['saved_bytes'] / 2**20)} MiB | "
                     f"{times(f['step_time_ratio'])} |")  # fmt: skip
    lines += ["", f"The planner's activation bytes per rank for this model and batch: "
              f"{sig(planned['plain'] / 2**20)} MiB, checkpointed {sig(planned['checkpointed'] / 2**20)} MiB "
              f"(it predicts {sig((planned['plain'] - planned['checkpointed']) / 2**20)} MiB freed). Step time: "
              f"checkpointed over plain, medians of samples/s after a warm-up step over {r['config']['repeats']} "
              "alternating runs each."]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
