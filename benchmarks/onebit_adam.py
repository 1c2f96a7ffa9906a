"""1-bit Adam (``CompressedDDPStrategy(compression=OneBitAdam())``) against dense fp32 AdamW DDP, in the same run.

    python -m benchmarks.onebit_adam [--seeds 3] [--quick] [--results-dir DIR]

The protocol of ``benchmarks/compression.py``'s quality runs (its worker runs each configuration): 2 ranks over
loopback, the GPT's validation loss after 100 steps and the CNN's test accuracy after 150, the same seeds for both
methods. Per run it records the bytes this rank sent and what an fp32 all-reduce of the same gradients would have
sent, over the whole run (the dense warm-up included) and over the compressed phase alone, as counted by the
strategy.

Quality target (issue 21): GPT validation loss within 2% of dense fp32, CNN accuracy within 0.5 points, with at
least 16x fewer bytes in the compressed phase and 5x over the whole run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, command_line, machine_info, print_table, run_worker, write_results

METHODS = ("fp32", "onebit_adam")
#: Ablations (``--methods``): with the paper's frozen variance (``variance_refresh=None``): as the paper, with the
#: momentum compressed with one scale per 256 values, and nearly losslessly (8-bit stochastic rounding with error
#: feedback), which leaves the frozen variance alone as the difference from Adam; and the defaults with a 25% dense
#: warm-up, which outlasts the char-GPT's 20-step learning-rate warm-up (the default 15% ends inside it). These ran
#: before the variance was tracked between refreshes and the momentum exchanged preconditioned, and still run so;
#: ``onebit_adam_raw`` is today's defaults with the raw momentum exchanged, ``onebit_adam_powersgd`` with the momentum
#: as PowerSGD(4) factors, ``onebit_adam_q8r`` with it in 8 bits (near-lossless: what the variance alone costs);
#: ``onebit_adam_squares10`` refreshes every 10th step from the ranks' own running second moments (``refresh_from=
#: "squares"``; ``results/onebit_adam_squares.json`` is the run that had it as the defaults).
ABLATIONS = (
    "onebit_adam_frozen",
    "onebit_adam_block",
    "onebit_adam_q8",
    "onebit_adam_refresh8_w25",
    "onebit_adam_raw",
    "onebit_adam_powersgd",
    "onebit_adam_q8r",
    "onebit_adam_squares10",
    "onebit_adam_q8r_every2",
    "onebit_adam_refresh4_4bit",
    "onebit_adam_q8r_plain",
    # One factor at a time, no guards (track_scale=False, preconditioned=False): the momentum in 1 bit or in 8 bits
    # (Quantize(8) with error feedback), the variance refreshed from 8-bit gradients every 2nd step or from 4-bit
    # gradients every 4th (results/onebit_adam_factors.json).
    "onebit_adam_every2_plain",
    "onebit_adam_q8r_every2_plain",
    "onebit_adam_refresh4_4bit_plain",
    "onebit_adam_q8r_refresh4_4bit_plain",
    # ZeRO-2 with a compressed reduce-scatter (issue 21 part 3), and ZeRO-2 dense: no dense warm-up, the whole run is
    # the compressed phase; bytes against a dense fp32 reduce-scatter.
    "zero2",
    "zero2_powersgd",
    "zero2_onebit",
    "zero2_topk",
)


def _args(method: str, model: str, steps: int, seed: int, quick: bool) -> list[str]:
    return ["--worker", "quality", "--method", method, "--model", model, "--steps", str(steps), "--warmup", "2",
            "--seed", str(seed), *(["--quick"] if quick else [])]  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per model and method (default 3)")
    parser.add_argument("--quick", action="store_true", help="a small GPT and few steps (a smoke run)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=(*METHODS, *ABLATIONS),
        default=list(METHODS),
        help="fp32 is always run (the peer); an ablation run is written to onebit_adam_ablation.json",
    )
    parser.add_argument("--models", nargs="+", choices=("gpt", "cnn"), default=["gpt", "cnn"])
    parser.add_argument(
        "--area", default=None, help="results file name (default: onebit_adam; onebit_adam_ablation for other methods)"
    )
    args = parser.parse_args(argv)
    methods = list(dict.fromkeys(["fp32", *args.methods]))
    name = args.area or (
        "onebit_adam" if methods == list(METHODS) and args.models == ["gpt", "cnn"] else "onebit_adam_ablation"
    )
    budgets = {m: {"gpt": 12 if args.quick else 100, "cnn": 20 if args.quick else 150}[m] for m in args.models}
    seeds = list(range(1 if args.quick else args.seeds))
    figures: dict[str, Any] = {}
    rows = []
    for model, steps in budgets.items():
        per_method: dict[str, Any] = {}
        for method in methods:
            runs = [
                run_worker("benchmarks.compression", _args(method, model, steps, seed, args.quick)) for seed in seeds
            ]
            values = [r["val_loss" if model == "gpt" else "test_acc"] for r in runs]
            entry: dict[str, Any] = {"values": values, "mean": statistics.fmean(values)}
            if "run_sent_bytes" in runs[0]:  # a compressor's engine counted the bytes
                entry["warmup_steps"] = runs[0].get("momentum_warmup_steps", 0)
                entry["whole_run_ratio"] = statistics.fmean(r["run_dense_bytes"] / r["run_sent_bytes"] for r in runs)
                entry["compressed_phase_ratio"] = statistics.fmean(
                    r.get("compressed_phase_dense_bytes", r["run_dense_bytes"])
                    / r.get("compressed_phase_sent_bytes", r["run_sent_bytes"])
                    for r in runs
                )
            per_method[method] = entry
            print(f"{model} {method}: {values}", flush=True)
        dense = per_method["fp32"]
        gaps = {}
        for method in methods[1:]:
            ours = per_method[method]
            gap = ours["mean"] / dense["mean"] - 1 if model == "gpt" else 100 * (ours["mean"] - dense["mean"])
            ours["gap"] = gaps[method] = gap
            rows.append({
                "model": model, "method": method, "metric": "val loss" if model == "gpt" else "test acc",
                "steps": steps, "fp32": dense["mean"], "ours": ours["mean"],
                "vs fp32": f"{100 * gap:+.2f}%" if model == "gpt" else f"{gap:+.2f} pts",
                "bytes compressed phase": ours.get("compressed_phase_ratio", 1.0),
                "bytes whole run": ours.get("whole_run_ratio", 1.0),
            })  # fmt: skip
        figures[model] = {"steps": steps, "seeds": seeds, "methods": per_method, "gap": gaps.get("onebit_adam")}
    print(f"\n{', '.join(methods[1:])} against dense fp32 AdamW DDP (loopback, 2 ranks)")
    figures["table"] = print_table(rows, list(rows[0]))
    from lightning_bigtrain.compression import OneBitAdam

    defaults = OneBitAdam()
    payload = {"config": {"quick": args.quick, "budgets": budgets, "seeds": seeds, "methods": methods,
                          "warmup_steps": defaults.warmup_steps, "variance_refresh": defaults.variance_refresh,
                          "track_scale": defaults.track_scale, "preconditioned": defaults.preconditioned,
                          "refresh_from": defaults.refresh_from},
               "machine": machine_info(), "figures": figures}  # fmt: skip
    headline = "; ".join(f"{r['model']} {r['method']} {r['vs fp32']}, bytes {r['bytes compressed phase']:.1f}x "
                         f"compressed / {r['bytes whole run']:.1f}x run" for r in rows)  # fmt: skip
    path = write_results(name, payload, headline, args.results_dir,
                         command=command_line("benchmarks.onebit_adam", argv))  # fmt: skip
    print(f"wrote {path}")
    return figures


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``onebit-adam`` block (docs/compression.md), from ``results/onebit_adam.json``."""
    from benchmarks.common import load_results, measured_line, sig

    results = load_results(results_dir, "onebit_adam.json")
    f = results["figures"]
    config = results.get("config") or {}
    every = config.get("variance_refresh")  # not recorded: the run before the refresh existed
    if not every:
        refresh = "the variance frozen after the warm-up"
    elif config.get("refresh_from") == "squares":  # not recorded: the runs that refreshed from sampled gradients
        refresh = (
            f"and every {every}th step the ranks' own running second moments averaged in 8 bits into the averaged "
            "gradient's variance"
        )
    else:
        refresh = f"and every {every}th step the gradients averaged in 8 bits to refresh the variance"
    if config.get("track_scale"):  # not recorded: the runs before the guards existed
        refresh += (
            "; between refreshes each tensor's variance scaled by its tracked gradient scale and raised to Adam's "
            "step bound, the momentum exchanged in the update's units"
        )
    squares_file = results_dir / "onebit_adam_squares.json"
    other = load_results(results_dir, "onebit_adam_squares.json") if squares_file.exists() else None
    first = measured_line(results, "onebit_adam.json", results_dir)
    if other is not None:  # the run that had refresh_from="squares" (every 10th step) as the defaults
        first += " The line under the table: " + measured_line(other, "onebit_adam_squares.json", results_dir)
    lines = [
        first,
        "",
        "Over loopback (both ranks on one host), the same seeds for both; `OneBitAdam()` as it was then (dense for "
        f"the first 15% of the steps, then 1-bit momentum with error feedback, {refresh}) against dense fp32 AdamW DDP "
        "after the same number of steps. Bytes: what an fp32 all-reduce of the gradients would send over what this "
        "rank sent, counted by the strategy.",
        "",
        "| model, metric | steps, seeds | dense fp32 | OneBitAdam | vs dense | bytes fewer, compressed phase | bytes "
        "fewer, whole run |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in ("gpt", "cnn"):
        q = f[model]
        ours, dense = q["methods"]["onebit_adam"], q["methods"]["fp32"]
        gpt = model == "gpt"
        gap = f"{100 * q['gap']:+.2f}%" if gpt else f"{q['gap']:+.2f} pts"
        value = (lambda v: sig(v)) if gpt else (lambda v: f"{100 * v:.2f}%")
        seeds = f"{len(q['seeds'])} seed" + ("s" if len(q["seeds"]) > 1 else "")
        lines.append(
            f"| {'char-GPT, val loss' if gpt else 'CNN, test accuracy'} | {q['steps']}, {seeds} | "
            f"{value(dense['mean'])} | {value(ours['mean'])} | {gap} | {ours['compressed_phase_ratio']:.1f}x | "
            f"{ours['whole_run_ratio']:.1f}x |"
        )
    if other is not None:
        g = other["figures"]
        lines += [
            "",
            f'`refresh_from="squares"`, `variance_refresh={other["config"]["variance_refresh"]}` (the ranks\' own '
            "running second moments; the defaults at the second commit named above, the same seeds): char-GPT "
            f"{100 * g['gpt']['gap']:+.2f}% val loss vs dense (per seed "
            f"{', '.join(sig(v) for v in g['gpt']['methods']['onebit_adam']['values'])} against "
            f"{', '.join(sig(v) for v in g['gpt']['methods']['fp32']['values'])}), CNN {g['cnn']['gap']:+.2f} pts; "
            f"bytes {g['gpt']['methods']['onebit_adam']['compressed_phase_ratio']:.1f}x fewer in the compressed "
            f"phase, {g['gpt']['methods']['onebit_adam']['whole_run_ratio']:.1f}x over the run.",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])


def render_zero2_block(results_dir: Path = RESULTS_DIR, name: str = "zero2_compression.json") -> str:
    """The ``zero2-compression`` block (docs/compression.md): ZeRO-2 with a compressed reduce-scatter against dense
    fp32 AdamW DDP, from ``results/zero2_compression.json`` (``--methods zero2_... --area zero2_compression``)."""
    from benchmarks.common import load_results, sig

    results = load_results(results_dir, name)
    f = results["figures"]
    from benchmarks.common import measured_line

    lines = [
        measured_line(results, name, results_dir),
        "",
        "Over loopback (2 ranks), the same seeds for every method; `ZeroStrategy(stage=2, compression=...)` with the "
        "compressor's defaults against dense fp32 AdamW DDP after the same number of steps. Bytes: what a dense fp32 "
        "reduce-scatter of the gradients would send over what this rank sent in the compressed reduce-scatter, "
        "counted by the strategy (no dense warm-up: the whole run is compressed).",
        "",
        "| model, metric | steps, seeds | method | dense fp32 | ZeRO-2 compressed | vs dense | bytes fewer |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in ("gpt", "cnn"):
        if model not in f:
            continue
        q = f[model]
        dense = q["methods"]["fp32"]
        gpt = model == "gpt"
        value = (lambda v: sig(v)) if gpt else (lambda v: f"{100 * v:.2f}%")
        seeds = f"{len(q['seeds'])} seed" + ("s" if len(q["seeds"]) > 1 else "")
        for method, ours in q["methods"].items():
            if method == "fp32":
                continue
            gap = f"{100 * ours['gap']:+.2f}%" if gpt else f"{ours['gap']:+.2f} pts"
            lines.append(
                f"| {'char-GPT, val loss' if gpt else 'CNN, test accuracy'} | {q['steps']}, {seeds} | `{method}` | "
                f"{value(dense['mean'])} | {value(ours['mean'])} | {gap} | {ours.get('whole_run_ratio', 1.0):.1f}x |"
            )
    return "\n".join(lines)


#: The factor ablation's methods: (momentum exchange, variance refresh).
FACTORS = {
    "onebit_adam_every2_plain": ("1 bit (`OneBit`)", "every 2nd step, 8-bit gradients"),
    "onebit_adam_q8r_every2_plain": ("8 bits (`Quantize(8)`)", "every 2nd step, 8-bit gradients"),
    "onebit_adam_refresh4_4bit_plain": ("1 bit (`OneBit`)", "every 4th step, 4-bit gradients"),
    "onebit_adam_q8r_refresh4_4bit_plain": ("8 bits (`Quantize(8)`)", "every 4th step, 4-bit gradients"),
}


def render_factors_block(results_dir: Path = RESULTS_DIR, name: str = "onebit_adam_factors.json") -> str:
    """The ``onebit-adam-factors`` block (docs/compression.md): OneBitAdam without its guards, the momentum's
    exchange and the variance's refresh varied one at a time, against dense fp32 AdamW DDP, from
    ``results/onebit_adam_factors.json``."""
    from benchmarks.common import load_results, measured_line, sig

    results = load_results(results_dir, name)
    q = results["figures"]["gpt"]
    dense = q["methods"]["fp32"]
    lines = [
        measured_line(results, name, results_dir),
        "",
        f"char-GPT, validation loss after {q['steps']} steps, seeds {', '.join(str(s) for s in q['seeds'])} (the same "
        f"for every row); dense fp32 AdamW: {sig(dense['mean'])} "
        f"(per seed {', '.join(sig(v) for v in dense['values'])}). "
        "Each row is `OneBitAdam` with `track_scale=False, preconditioned=False` (no guards), "
        f"`warmup_steps={results['config']['warmup_steps']}` (dense steps first), and the momentum exchanged with "
        "error feedback as the row says:",
        "",
        "| momentum exchanged in | variance refreshed | val loss (per seed) | vs dense | bytes fewer, compressed phase "
        "| bytes fewer, whole run |",
        "|---|---|---|---|---|---|",
    ]
    for method, (momentum, refresh) in FACTORS.items():
        if method not in q["methods"]:
            continue
        ours = q["methods"][method]
        lines.append(
            f"| {momentum} | {refresh} | {sig(ours['mean'])} ({', '.join(sig(v) for v in ours['values'])}) | "
            f"{100 * ours['gap']:+.2f}% | {ours['compressed_phase_ratio']:.1f}x | {ours['whole_run_ratio']:.2f}x |"
        )
    return "\n".join(lines)
