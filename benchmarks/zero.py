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
all-reduce as 2 (N-1)/N B). DDP's all-reduce runs inside its C++ reducer, out of the wrapper's sight: the DDP
run registers torch's own ``allreduce_hook`` (the reducer's all-reduce, issued from Python; DDP's results are
unchanged) behind a counting hook, so its bytes are counted per bucket (and seen by the wrapper too). The
results record which it was (``ddp_bytes_sent_source``: ``"comm hook"``; files written before it have the ring
formula over the gradient bytes, ``"formula"``). The figures are rendered into docs/zero.md by
:func:`render_block`.
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
    command_line,
    count_collectives,
    print_table,
    ratio,
    run_worker,
    summarize,
    write_results,
)

CONFIGS = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload", "ds_zero1", "ds_zero2", "ds_zero3")
DEFAULT_CONFIGS = CONFIGS  # offload on DeepSpeed's engine is the same run on CPU too: left out


def worker(config: str, steps: int, quick: bool, out: str, mmap_threshold: str = "default") -> None:
    import resource

    import lightning as L

    from benchmarks.common import zero_benchmark_model
    from lightning_bigtrain.callbacks import RunReport
    from lightning_bigtrain.strategies import ZeroOptions, zero_strategy

    data, model, psi = zero_benchmark_model(quick)
    if config == "ddp":
        strategy: Any = "ddp"
    else:
        engine = "deepspeed" if config.startswith("ds_") else "torch"
        stage = int(config.removeprefix("ds_")[4])
        offload = config.endswith("offload")
        options = (
            {}
            if mmap_threshold == "default"
            else {"options": ZeroOptions(host_mmap_threshold=_threshold(mmap_threshold))}
        )
        strategy = zero_strategy(stage, engine=engine, offload_optimizer=offload,
                                offload_params=offload and stage == 3, **options)  # fmt: skip
    report = RunReport(warmup_steps=2, verbose=False)

    class StepCounter(L.Callback):
        """Bytes sent from the third step to the end: the strategy's own count and the wrapper's."""

        def _read(self, trainer) -> tuple[int, int]:
            own = ddp_sent["bytes"] if config == "ddp" else getattr(trainer.strategy, "comm_bytes", None)
            return (-1 if own is None else own), counter["bytes"]

        def on_fit_start(self, trainer, pl_module):
            if config == "ddp":  # the reducer's all-reduce, through a hook that counts each bucket it sends
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

                world = trainer.world_size

                def counting(state, bucket):
                    buffer = bucket.buffer()
                    ddp_sent["bytes"] += 2 * (world - 1) / world * buffer.numel() * buffer.element_size()
                    return allreduce_hook(state, bucket)

                trainer.strategy.model.register_comm_hook(None, counting)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 2:
                self.start = self._read(trainer)
                self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        def on_train_end(self, trainer, pl_module):
            self.end = self._read(trainer)
            self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self.faults

    ddp_sent = {"bytes": 0.0}
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
    if trainer.is_global_zero:
        result = {**report.report, "psi": psi, "bytes_sent_per_step": own, "bytes_sent_wrapped": wrapped,
                  "step_seconds": report.report["seconds"] / timed, "world_size": trainer.world_size,
                  "page_faults_per_step": steps_cb.faults / timed,
                  "bytes_sent_source": "comm hook" if config == "ddp" else "strategy"}  # fmt: skip
        Path(out).write_text(json.dumps(result))


THRESHOLDS = ("none", "8MiB", "128KiB")  # the allocator sweep: glibc's own, the default, the previous default


def _threshold(text: str) -> int | None:
    """``ZeroOptions(host_mmap_threshold=...)`` from a sweep label: ``none`` leaves glibc's own (dynamic) one."""
    from lightning_bigtrain.functional.memory import parse_bytes

    return None if text == "none" else parse_bytes(text)


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
    parser.add_argument("--allocator", action="store_true",
                        help="the host allocator sweep: stages 1 and 3 at each ZeroOptions(host_mmap_threshold) "
                             "of THRESHOLDS against DDP (results/zero_allocator.json)")  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mmap-threshold", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.quick, args.out, args.mmap_threshold)
        return {}
    if args.allocator:
        return allocator(args.quick, args.repeats or (1 if args.quick else 3), args.results_dir, argv)

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
        print("\nDeepSpeed's engine vs the torch engine (DeepSpeedZeroStrategy / ZeroStrategy), per rank")
        engine_table = print_table(engines, list(engines[0]))
        headline += "; deepspeed/torch step " + ", ".join(f"z{e['stage']} x{e['step ds/torch']:.2f}" for e in engines)
    payload = {"config": {"repeats": repeats, "steps": steps, "quick": args.quick, "psi": psi,
                          "world_size": ddp[0].get("world_size", 2)},
               "ddp_bytes_sent_source": ddp[0].get("bytes_sent_source", "formula"),
               "figures": figures, "table": table, "engines": engines, "engine_table": engine_table}  # fmt: skip
    path = write_results("zero", payload, headline, args.results_dir, command=command_line("benchmarks.zero", argv))
    print(f"wrote {path}")
    return figures


def allocator(quick: bool, repeats: int, results_dir: Path, argv: list[str] | None) -> dict[str, Any]:
    """Step time, peak RSS and page faults per step of ZeRO stages 1 and 3 at each host mmap threshold, against DDP
    in the same run (each configuration in fresh processes, alternating)."""
    steps = 5 if quick else 8
    extra = ["--quick"] if quick else []

    def run(config: str, threshold: str) -> dict[str, Any]:
        return run_worker("benchmarks.zero", ["--worker", config, "--steps", str(steps), "--mmap-threshold", threshold,
                                              *extra])  # fmt: skip

    candidates = {"ddp": lambda: run("ddp", "default")}
    for stage in (1, 3):
        for threshold in THRESHOLDS:
            candidates[f"zero{stage}@{threshold}"] = lambda s=stage, t=threshold: run(f"zero{s}", t)
    run("ddp", "default")  # warm-up, discarded
    measured = alternate(candidates, repeats)
    ddp_time = summarize([r["step_seconds"] for r in measured["ddp"]])["median"]
    ddp_rss = max(max(r["peak_memory_bytes_per_rank"]) for r in measured["ddp"])
    figures, rows = {}, []
    for name, runs in measured.items():
        step = summarize([r["step_seconds"] for r in runs])
        rss = max(max(r["peak_memory_bytes_per_rank"]) for r in runs)
        faults = summarize([r["page_faults_per_step"] for r in runs])["median"]
        figures[name] = {"step_seconds": step, "step_time_over_ddp": ratio(step["median"], ddp_time),
                         "peak_rss_bytes": rss, "peak_rss_over_ddp": ratio(rss, ddp_rss),
                         "page_faults_per_step": faults}  # fmt: skip
        rows.append({"config": name, "step s": step["median"], "step / DDP": figures[name]["step_time_over_ddp"],
                     "peak RSS MiB": rss / 2**20, "RSS / DDP": figures[name]["peak_rss_over_ddp"],
                     "page faults / step": faults})  # fmt: skip
    print(f"\nHost allocator: ZeRO at each host_mmap_threshold vs DDP ({repeats} repeats, medians)")
    table = print_table(rows, list(rows[0]))
    headline = ", ".join(f"{n}: step x{f['step_time_over_ddp']:.2f}, RSS x{f['peak_rss_over_ddp']:.2f}"
                         for n, f in figures.items() if n != "ddp")  # fmt: skip
    payload = {"config": {"repeats": repeats, "steps": steps, "quick": quick, "thresholds": list(THRESHOLDS)},
               "figures": figures, "table": table}  # fmt: skip
    path = write_results("zero_allocator", payload, headline, results_dir,
                         command=command_line("benchmarks.zero", argv))  # fmt: skip
    print(f"wrote {path}")
    return figures


def render_allocator_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``zero-allocator`` figure block (docs/zero.md), from ``results/zero_allocator.json``."""
    from benchmarks.common import load_results, measured_line, sig, times

    results = load_results(results_dir, "zero_allocator.json")
    f, cfg = results["figures"], results.get("config", {})
    lines = [
        measured_line(results, "zero_allocator.json", results_dir),
        "",
        f"The char-GPT above, fp32 AdamW, 2 CPU ranks, {cfg.get('steps', '?')} steps per run, "
        f"{cfg.get('repeats', '?')} alternating repeats in fresh processes; ratios to DDP in the same run. Page "
        "faults: minor faults per step of rank 0 (memory the kernel maps and zeroes).",
        "",
        "| configuration | `host_mmap_threshold` | step time, s: median (min-max) | step / DDP | peak RSS per rank, "
        "MiB | RSS / DDP | page faults per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in f.items():
        config, _, threshold = name.partition("@")
        step = r["step_seconds"]
        label = {"none": "None (glibc's own)", "": "-"}.get(threshold, threshold)
        lines.append(
            f"| {NAMES.get(config, config)} | {label} | {sig(step['median'])} ({sig(step['min'])}-{sig(step['max'])})"
            f" | {times(r['step_time_over_ddp'])} | {sig(r['peak_rss_bytes'] / 2**20)} | "
            f"{times(r['peak_rss_over_ddp'])} | {sig(r['page_faults_per_step'])} |"
        )
    return "\n".join(lines)


NAMES = {"ddp": "DDP (Lightning)", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
         "zero2_offload": "ZeRO-2 offload", "zero3_offload": "ZeRO-3 offload"}  # fmt: skip


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``zero`` figure block (docs/zero.md), from ``results/zero.json`` only: per configuration (the torch
    engine and DDP) model-state bytes per parameter against the ZeRO paper's formula, bytes sent per step and
    their ratio to DDP (DDP's labelled with how it was obtained), step time and its ratio to DDP, peak RSS per
    rank; then, where the file has them, DeepSpeed's engine over the torch engine at each stage."""
    from benchmarks.common import load_results, measured_line, sig, times

    results = load_results(results_dir, "zero.json")
    f, cfg = results["figures"], results.get("config", {})
    ranks = len(f["ddp"]["model_state_bytes_per_rank"])
    # Files written before the label was recorded computed DDP's figure from the ring formula.
    source = results.get("ddp_bytes_sent_source", "formula")
    how = {"formula": "DDP: the ring formula 2(N-1)/N x 4 bytes x parameters, not counted",
           "comm hook": "DDP: counted by a comm hook on its all-reduce"}.get(source, f"DDP: {source}")  # fmt: skip
    lines = [
        measured_line(results, "zero.json", results_dir),
        "",
        f"Char-GPT of {sig(cfg['psi'] / 1e6)}M parameters, fp32 AdamW, {ranks} CPU ranks over gloo, "
        f"{cfg.get('steps', '?')} steps per run, {cfg.get('repeats', '?')} alternating repeats; ratios to DDP "
        f"in the same run. Bytes sent: ring-equivalent bytes per rank per step ({how}).",
        "",
        "| configuration | model states, bytes/param (ZeRO formula) | bytes sent, MiB/step | sent / DDP "
        "| step time, s: median (min-max) | step / DDP | peak RSS per rank, MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for config, r in f.items():
        if config.startswith("ds_"):
            continue
        step = r["step_seconds"]
        sent = sig(r["bytes_sent_per_step"] / 2**20) + (f" ({source})" if config == "ddp" else "")
        lines.append(
            f"| {NAMES.get(config, config)} | {sig(r['bytes_per_param'])} "
            f"({sig(r['bytes_per_param'] / r['state_over_theory'])}) | {sent} | {times(r['sent_over_ddp'])} "
            f"| {sig(step['median'])} ({sig(step['min'])}-{sig(step['max'])}) | {times(r['step_time_over_ddp'])} "
            f"| {sig(max(r['peak_rss_mib_per_rank']))} |"
        )
    if results.get("engines"):
        lines += [
            "",
            "DeepSpeed's engine over the torch engine, same model and run (DeepSpeed keeps no byte count: its bytes "
            "sent are the collective wrapper's):",
            "",
            "| stage | step time | model-state bytes | peak RSS | bytes sent | DeepSpeed bytes/param (torch) |",
            "|---|---|---|---|---|---|",
        ]
        for e in results["engines"]:
            lines.append(
                f"| {e['stage']} | {times(e['step ds/torch'])} | {times(e['state ds/torch'])} "
                f"| {times(e['peak RSS ds/torch'])} | {times(e['sent ds/torch'])} "
                f"| {sig(e['ds B/param'])} ({sig(e['torch B/param'])}) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
