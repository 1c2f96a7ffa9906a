"""Pure-bf16 training with compensated updates vs fp32 and Lightning's bf16 modes: quality, memory, time.

    python -m benchmarks.precision [--quick] [--results-dir DIR]

The char-GPT on Shakespeare, one CPU process per configuration, the same seed, data and number of steps:
Lightning ``precision="32-true"`` (fp32, the reference), ``"bf16-mixed"`` and ``"bf16-true"`` (the peers),
and ``BF16Precision`` with compensation none / kahan / stochastic. Reported per configuration: the final
validation loss (the trained weights evaluated in fp32 on the same validation batches for every
configuration, so that bf16 arithmetic in evaluation does not blur the comparison of the weights),
model-state bytes (parameters + gradients + optimizer states, taken at an optimizer step), the median
step time after warm-up, and the ratios to fp32 (and to ``bf16-mixed`` for time).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, command_line, print_table, ratio, run_worker, write_results

CONFIGS = ("fp32", "bf16-mixed", "bf16-true", "ours-none", "ours-kahan", "ours-stochastic")


def worker(config: str, steps: int, quick: bool, out: str, lr: float | None) -> None:
    import lightning as L
    import torch

    from benchmarks.common import set_flush_denormal
    from lightning_bigtrain.callbacks import RunReport
    from lightning_bigtrain.data import ShakespeareDataModule
    from lightning_bigtrain.models import CharGPT
    from lightning_bigtrain.plugins import BF16Precision

    set_flush_denormal()
    L.seed_everything(0, verbose=False)
    data = ShakespeareDataModule(block_size=128, batch_size=16)
    width, layers = (128, 2) if quick else (384, 6)
    lr_kwargs = {} if lr is None else {"lr": lr}
    model = CharGPT(vocab_size=data.vocab_size, block_size=128, n_layer=layers, n_head=6 if not quick else 4,
                    n_embd=width, **lr_kwargs)  # fmt: skip
    psi = sum(p.numel() for p in model.parameters())
    kwargs: dict[str, Any] = {}
    if config.startswith("ours-"):
        kwargs["plugins"] = [BF16Precision(config.removeprefix("ours-"))]  # type: ignore[arg-type]
    else:
        kwargs["precision"] = {"fp32": "32-true"}.get(config, config)
    report = RunReport(warmup_steps=max(2, steps // 10), verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[report], **kwargs)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    # The trained weights, evaluated identically for every configuration: in fp32, on fixed batches.
    model = model.float().eval()
    losses = []
    with torch.no_grad():
        for i, batch in enumerate(data.val_dataloader()):
            if i == (4 if quick else 40):
                break
            losses.append(model._loss(batch).item())
    result = {**report.report, "psi": psi, "val_loss": sum(losses) / len(losses),
              "step_seconds": report.report["seconds"] / report.report["timed_steps"]}  # fmt: skip
    Path(out).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                        help="subset to run (fp32, the reference, always runs)")  # fmt: skip
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: CharGPT's 3e-3); results go to precision_lr<LR>.json",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or (20 if args.quick else 250)
    if args.worker:
        worker(args.worker, steps, args.quick, args.out, args.lr)
        return {}

    extra = (["--quick"] if args.quick else []) + ([] if args.lr is None else ["--lr", str(args.lr)])
    configs = ["fp32", *(c for c in args.configs if c != "fp32")]
    runs = {c: run_worker("benchmarks.precision", ["--worker", c, "--steps", str(steps), *extra]) for c in configs}
    ref = runs["fp32"]
    mixed = runs.get("bf16-mixed")
    psi = ref["psi"]
    rows, figures = [], {}
    for config in configs:
        r = runs[config]
        state = max(r["model_state_bytes_per_rank"])
        figures[config] = {
            "val_loss": r["val_loss"],
            "val_loss_over_fp32": ratio(r["val_loss"], ref["val_loss"]),
            "model_state_bytes": state,
            "bytes_per_param": state / psi,
            "state_over_fp32": ratio(state, max(ref["model_state_bytes_per_rank"])),
            "step_seconds": r["step_seconds"],
            "step_time_over_fp32": ratio(r["step_seconds"], ref["step_seconds"]),
            "step_time_over_bf16_mixed": ratio(r["step_seconds"], mixed["step_seconds"]) if mixed else None,
            "peak_rss_mib": max(r["peak_memory_bytes_per_rank"]) / 2**20,
            "train_loss_end": r["train_loss_end"],
        }
        f = figures[config]
        rows.append({
            "config": config,
            "val loss": f["val_loss"],
            "val / fp32": f["val_loss_over_fp32"],
            "bytes/param": f["bytes_per_param"],
            "state / fp32": f["state_over_fp32"],
            "step s": f["step_seconds"],
            "step / fp32": f["step_time_over_fp32"],
            "step / bf16-mixed": f["step_time_over_bf16_mixed"] if mixed else "-",
            "peak RSS MiB": f["peak_rss_mib"],
        })  # fmt: skip
    lr_text = "CharGPT's default peak lr 3e-3" if args.lr is None else f"peak lr {args.lr:g}"
    print(f"\nPrecision, char-GPT {psi / 1e6:.1f}M params, AdamW ({lr_text}), {steps} steps, 1 CPU process")
    table = print_table(rows, list(rows[0]))
    headline = ", ".join(
        f"{c}: val x{figures[c]['val_loss_over_fp32']:.3f}, state x{figures[c]['state_over_fp32']:.2f}, "
        f"step x{figures[c]['step_time_over_fp32']:.2f}"
        for c in ("bf16-true", "ours-kahan", "ours-stochastic")
        if c in figures
    )
    payload = {"config": {"steps": steps, "quick": args.quick, "psi": psi, "lr": args.lr}, "figures": figures,
               "table": table}  # fmt: skip
    area = "precision" if args.lr is None else f"precision_lr{args.lr:g}"
    path = write_results(area, payload, headline, args.results_dir, command=command_line("benchmarks.precision", argv))
    print(f"wrote {path}")
    return figures


LABELS = {"fp32": "fp32 (`32-true`)", "bf16-mixed": "Lightning `bf16-mixed`", "bf16-true": "Lightning `bf16-true`",
          "ours-none": "`BF16Precision(\"none\")`", "ours-kahan": "`BF16Precision(\"kahan\")`",
          "ours-stochastic": "`BF16Precision(\"stochastic\")`"}  # fmt: skip


def results_files(results_dir: Path = RESULTS_DIR) -> list[str]:
    """The precision results files in ``results_dir``: the default learning rate's first, then ``--lr`` runs."""
    lr = sorted(p.name for p in Path(results_dir).glob("precision_lr*.json"))
    return (["precision.json"] if (Path(results_dir) / "precision.json").exists() else []) + lr


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``precision`` figure block (docs/bf16.md), from ``results/precision.json`` and every
    ``results/precision_lr*.json``: per file its run line and, per configuration, the final validation loss and
    its ratio to fp32, model-state bytes per parameter and their ratio to fp32, step time over fp32 and over
    ``bf16-mixed``, and peak RSS."""
    from benchmarks.common import load_results, measured_line, percent, sig, times

    names = results_files(results_dir)
    if not names:
        load_results(results_dir, "precision.json")  # raises, naming the benchmark to run
    lines: list[str] = []
    for name in names:
        results = load_results(results_dir, name)
        cfg = results.get("config", {})
        lr = f"peak lr {cfg['lr']:g}" if cfg.get("lr") is not None else "the model's default peak lr (not recorded)"
        lines += [
            *([""] if lines else []),
            measured_line(results, name, results_dir),
            "",
            f"Char-GPT of {sig(cfg['psi'] / 1e6)}M parameters, AdamW at {lr}, {cfg['steps']} steps, one CPU process "
            "per configuration, one run each; validation loss of the trained weights evaluated in fp32.",
            "",
            "| configuration | val loss | val loss vs fp32 | model states, bytes/param | states / fp32 | step / fp32 "
            "| step / `bf16-mixed` | peak RSS, MiB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for config, f in results["figures"].items():
            mixed = f.get("step_time_over_bf16_mixed")
            lines.append(
                f"| {LABELS.get(config, config)} | {sig(f['val_loss'])} | {percent(f['val_loss_over_fp32'] - 1)} "
                f"| {sig(f['bytes_per_param'])} | {times(f['state_over_fp32'])} | {times(f['step_time_over_fp32'])} "
                f"| {times(mixed) if mixed is not None else '-'} | {sig(f['peak_rss_mib'])} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
