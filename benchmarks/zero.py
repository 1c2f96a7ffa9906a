"""ZeRO stages vs DDP: per-rank model-state bytes, bytes sent per step, step time, peak RSS.

    python -m benchmarks.zero [--quick] [--repeats N] [--results-dir DIR]

A char-GPT of 25M parameters (8 layers, width 512) trained with fp32 AdamW on Shakespeare at world
size 2 (CPU, gloo): plain Lightning DDP (the peer) and ZeroStrategy stages 1/2/3 (offload variants too:
on CPU they are the same runs, and say so with a NoEffectWarning), on the torch engine and on DeepSpeed's
(``engine="deepspeed"``, rows ``ds_zero*``; its offload rows are left out, the same runs on CPU). DeepSpeed
keeps no byte count of its own, so its "sent" figure is the wrapper's. Model-state bytes per rank are taken
at the first optimizer step (parameters, gradients, optimizer states) and compared with the ZeRO paper's
formulas (Rajbhandari et al., 2020, Fig. 1): DDP 16 Psi; stage 1 (8 + 8/N) Psi; stage 2 (4 + 12/N) Psi;
stage 3 16 Psi / N. Bytes sent per step are the strategy's own count (``ZeroStrategy.comm_bytes``,
ring-equivalent: an all-gather or reduce-scatter of B bytes sends (N-1)/N B), checked against a wrapper
around torch.distributed's collective functions that counts every collective the rank issues (an
all-reduce as 2 (N-1)/N B); DDP's all-reduce runs inside its C++ reducer, so its figure is the ring
formula over its gradient bytes.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    alternate,
    count_collectives,
    print_table,
    ratio,
    run_worker,
    summarize,
    write_results,
)

CONFIGS = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "ds_zero1", "ds_zero2", "ds_zero3")
DEFAULT_CONFIGS = CONFIGS  # offload on DeepSpeed's engine is the same run on CPU too: left out


def worker(config: str, steps: int, quick: bool, out: str) -> None:
    import lightning as L

    from benchmarks.common import zero_benchmark_model
    from lightning_bigtrain.callbacks import RunReport
    from lightning_bigtrain.strategies import ZeroStrategy

    data, model, psi = zero_benchmark_model(quick)
    if config == "ddp":
        strategy: Any = "ddp"
    else:
        engine = "deepspeed" if config.startswith("ds_") else "torch"
        stage = int(config.removeprefix("ds_")[4])
        offload = config.endswith("offload")
        strategy = ZeroStrategy(stage=stage, engine=engine, offload_optimizer=offload,
                                offload_params=offload and stage == 3)  # fmt: skip
    report = RunReport(warmup_steps=2, verbose=False)

    class StepCounter(L.Callback):
        """Bytes sent from the third step to the end: the strategy's own count and the wrapper's."""

        def _read(self, trainer) -> tuple[int, int]:
            own = getattr(trainer.strategy, "comm_bytes", None)
            return (-1 if own is None else own), counter["bytes"]

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                self.start = self._read(trainer)

        def on_train_end(self, trainer, pl_module):
            self.end = self._read(trainer)

    steps_cb = StepCounter()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[report, steps_cb])  # fmt: skip
    with warnings.catch_warnings(), count_collectives(2) as counter:
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    timed = steps - 2
    own, wrapped = ((end - start) / timed for start, end in zip(steps_cb.start, steps_cb.end, strict=True))
    if steps_cb.start[0] < 0:  # DeepSpeed's engine keeps no count of its own: the wrapper's
        own = wrapped
    if config == "ddp":
        own = wrapped = 2 * (2 - 1) / 2 * psi * 4  # DDP's reducer all-reduces every fp32 gradient once per step
    if trainer.is_global_zero:
        result = {**report.report, "psi": psi, "bytes_sent_per_step": own, "bytes_sent_wrapped": wrapped,
                  "step_seconds": report.report["seconds"] / timed}  # fmt: skip
        Path(out).write_text(json.dumps(result))


def theory_bytes(config: str, psi: int, n: int = 2) -> float:
    """ZeRO paper, fp32 AdamW: bytes per rank of parameters + gradients + optimizer states."""
    stage = 0 if config == "ddp" else int(config.removeprefix("ds_")[4])
    return psi * {0: 16, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n}[stage]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS),
                        help="subset to run (ddp, the peer, always runs)")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.quick, args.out)
        return {}

    repeats = args.repeats or (1 if args.quick else 3)
    steps = 5 if args.quick else 8
    extra = ["--quick"] if args.quick else []

    def run(config: str) -> dict[str, Any]:
        return run_worker("benchmarks.zero", ["--worker", config, "--steps", str(steps), *extra])

    configs = ["ddp", *(c for c in args.configs if c != "ddp")]
    run("ddp")  # warm-up, discarded: the first worker of a session pays cold file-cache and import costs
    measured = alternate({c: (lambda c=c: run(c)) for c in configs}, repeats)
    ddp = measured["ddp"]
    ddp_time = summarize([r["step_seconds"] for r in ddp])["median"]
    ddp_sent = ddp[0]["bytes_sent_per_step"]
    psi = ddp[0]["psi"]
    rows, figures = [], {}
    for config in configs:
        runs = measured[config]
        state = max(runs[0]["model_state_bytes_per_rank"])
        step = summarize([r["step_seconds"] for r in runs])
        sent = runs[0]["bytes_sent_per_step"]
        figures[config] = {
            "model_state_bytes_per_rank": runs[0]["model_state_bytes_per_rank"],
            "bytes_per_param": state / psi,
            "state_over_theory": ratio(state, theory_bytes(config, psi)),
            "state_over_ddp": ratio(state, max(ddp[0]["model_state_bytes_per_rank"])),
            "bytes_sent_per_step": sent,
            "bytes_sent_wrapped": runs[0]["bytes_sent_wrapped"],
            "sent_over_allreduce_volume": ratio(sent, 2 * (2 - 1) / 2 * psi * 4),
            "sent_over_ddp": ratio(sent, ddp_sent),
            "step_seconds": step,
            "step_time_over_ddp": ratio(step["median"], ddp_time),
            "peak_rss_mib_per_rank": [b / 2**20 for b in runs[0]["peak_memory_bytes_per_rank"]],
        }
        f = figures[config]
        rows.append({
            "config": config,
            "bytes/param": f["bytes_per_param"],
            "state / theory": f["state_over_theory"],
            "sent MiB/step": sent / 2**20,
            "sent / DDP": f["sent_over_ddp"],
            "own / wrapped": ratio(sent, f["bytes_sent_wrapped"]),
            "step s": step["median"],
            "step / DDP": f["step_time_over_ddp"],
            "peak RSS MiB": max(f["peak_rss_mib_per_rank"]),
        })  # fmt: skip
    print(f"\nZeRO vs DDP, char-GPT {psi / 1e6:.1f}M params, fp32 AdamW, 2 CPU ranks ({repeats} repeats, medians)")
    table = print_table(rows, list(rows[0]))
    headline = ", ".join(
        f"{c}: {figures[c]['bytes_per_param']:.1f} B/param, step x{figures[c]['step_time_over_ddp']:.2f}"
        for c in ("zero1", "zero2", "zero3")
        if c in figures
    )
    engines = []
    for stage in (1, 2, 3):
        torch_f, ds_f = figures.get(f"zero{stage}"), figures.get(f"ds_zero{stage}")
        if torch_f is None or ds_f is None:
            continue
        engines.append({
            "stage": stage,
            "state ds/torch": ratio(
                max(ds_f["model_state_bytes_per_rank"]), max(torch_f["model_state_bytes_per_rank"])
            ),
            "peak RSS ds/torch": ratio(max(ds_f["peak_rss_mib_per_rank"]), max(torch_f["peak_rss_mib_per_rank"])),
            "step ds/torch": ratio(ds_f["step_seconds"]["median"], torch_f["step_seconds"]["median"]),
            "sent ds/torch": ratio(ds_f["bytes_sent_per_step"], torch_f["bytes_sent_per_step"]),
            "ds B/param": ds_f["bytes_per_param"],
            "torch B/param": torch_f["bytes_per_param"],
        })  # fmt: skip
    engine_table = None
    if engines:
        print("\nDeepSpeed's engine vs the torch engine (ZeroStrategy(engine='deepspeed') / engine='torch'), per rank")
        engine_table = print_table(engines, list(engines[0]))
        headline += "; deepspeed/torch step " + ", ".join(f"z{e['stage']} x{e['step ds/torch']:.2f}" for e in engines)
    payload = {"config": {"repeats": repeats, "steps": steps, "quick": args.quick, "psi": psi},
               "figures": figures, "table": table, "engines": engines, "engine_table": engine_table}  # fmt: skip
    print(f"wrote {write_results('zero', payload, headline, args.results_dir)}")
    return figures


if __name__ == "__main__":
    main(sys.argv[1:])
