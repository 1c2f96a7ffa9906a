"""Tensor parallelism against the planner and against DDP: model states, bytes sent, step time.

    python -m benchmarks.parallel [--quick] [--steps 12] [--results-dir DIR]

The ZeRO benchmarks' char-GPT (25M parameters: 8 layers, width 512, 8 heads; ``--quick``: 2 layers, width 128),
batch 4 x 128 characters per data-parallel rank, fp32 AdamW on Shakespeare, CPU over gloo, each layout in a fresh
process:

* ``ddp``: Lightning's DDP on 2 ranks (the peer for step time);
* ``tp2``: ``ZeroStrategy(stage=3, tensor_parallel=2)`` on 2 ranks (one tensor-parallel pair);
* ``dp2_tp2``: the same with ``devices=4`` (two pairs, ZeRO-3 across them; 4 processes on 2 cores, so its step
  time is not reported, only its bytes and states).

Measured per rank: the model states at the second step (``model_state_bytes``: local shards of the split and
FSDP2-sharded parameters, their gradients and AdamW's moments) against the planner's ``zero3_tp2`` row (exact);
the bytes the tensor-parallel collectives send in one step, counted where DTensor issues them (its functional
collectives, ring equivalent) against the planner's message sizes measured on fake tensors (exact); the bytes
that step's forward saves for backward (distinct storages, a DTensor's local one, weights excluded) against the
planner's activations (fake tensors, split regions divided by the degree; within 10% asked); and the median step
time over the steps after two warm-up steps. The speed figure is throughput (tokens per second over the job)
against DDP's: at the same per-rank batch, DDP's 2 ranks train on two batches per step and one tensor-parallel
pair on one. Rendered into docs/parallel.md by :func:`render_block`.
"""

from __future__ import annotations

import argparse
import json
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, command_line, print_table, ratio, run_worker, write_results

LAYOUTS = {"ddp": (2, 1), "tp2": (2, 2), "dp2_tp2": (4, 2), "pp2": (2, 1), "pp2_gpipe": (2, 1)}  # devices, TP degree
PIPELINES = {"pp2": "1f1b", "pp2_gpipe": "gpipe"}  # pipeline layouts: 2 stages, 4 micro-batches of 1
BATCH, BLOCK = 4, 128


@contextmanager
def count_tensor_parallel_bytes(degree: int) -> Any:
    """Ring-equivalent bytes this rank sends through DTensor's functional collectives (all-reduce twice
    ``(T-1)/T`` of the message, all-gather ``(T-1)/T`` of its output, reduce-scatter of its input)."""
    import torch.distributed._functional_collectives as funcol

    counted = {"bytes": 0.0, "collectives": 0}
    factor = (degree - 1) / degree

    def size(t: Any) -> int:
        return int(t.numel() * t.element_size())

    measures = {
        "all_reduce": lambda t: 2 * factor * size(t),
        "all_gather_single": lambda t: (degree - 1) * size(t),
        "reduce_scatter_single": lambda t: factor * size(t),
    }
    originals = {name: getattr(funcol, name) for name in measures}

    def wrap(name: str) -> Any:
        def counting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            counted["bytes"] += measures[name](tensor)
            counted["collectives"] += 1
            return originals[name](tensor, *args, **kwargs)

        return counting

    for name in measures:
        setattr(funcol, name, wrap(name))
    try:
        yield counted
    finally:
        for name, fn in originals.items():
            setattr(funcol, name, fn)


def worker(layout: str, quick: bool, steps: int, out: str) -> None:
    import lightning as L
    import torch

    from benchmarks.common import zero_benchmark_model
    from lightning_bigtrain.callbacks import RunReport
    from lightning_bigtrain.functional.sharding import local_view
    from lightning_bigtrain.strategies import PipelineOptions, ZeroStrategy

    devices, degree = LAYOUTS[layout]
    data, model, psi = zero_benchmark_model(quick)
    strategy: Any = "ddp" if layout == "ddp" else ZeroStrategy(stage=3, tensor_parallel=degree)
    if layout in PIPELINES:
        strategy = ZeroStrategy(pipeline_parallel=2, pipeline=PipelineOptions(schedule=PIPELINES[layout]))  # type: ignore[arg-type]
    counted: dict[str, Any] = {}
    bubbles: list[float] = []
    steady: list[float] = []

    class OneStep(L.Callback):
        """Count the tensor-parallel bytes of the third step (forward, backward and update) and the bytes its forward
        saves for backward on this rank (distinct storages, a DTensor's local one, parameters excluded)."""

        context: Any = None

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            if trainer.global_step != 2:
                return
            if degree > 1:
                self.context = count_tensor_parallel_bytes(degree)
                self.counts = self.context.__enter__()
            if layout in PIPELINES:
                self.comm = trainer.strategy.comm_bytes
            weights = {local_view(p).untyped_storage().data_ptr() for p in pl_module.parameters()}
            saved: dict[int, int] = {}
            runner = getattr(trainer.strategy, "_pipeline", None)
            self.by_microbatch: dict[int, dict[int, int]] = {}

            def pack(t: Any) -> Any:
                storage = local_view(t).untyped_storage()
                if storage.data_ptr() not in weights:
                    saved[storage.data_ptr()] = storage.nbytes()
                    if runner is not None and runner.current is not None:
                        mb = self.by_microbatch.setdefault(runner.current[1], {})
                        mb[storage.data_ptr()] = storage.nbytes()
                return t

            self.saved = saved
            self.hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self.hooks.__enter__()

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            if self.context is not None:
                self.context.__exit__(None, None, None)
                counted.update(self.counts)
                self.context = None
            if getattr(self, "hooks", None) is not None:
                self.hooks.__exit__(None, None, None)
                self.hooks = None
                counted["activations"] = float(sum(self.saved.values()))
                if layout in PIPELINES:
                    # The peak held at once: each micro-batch's saved bytes, from its forward to its backward, in the
                    # order this rank ran them.
                    strategy = trainer.strategy
                    counted["bytes"] = float(strategy.comm_bytes - self.comm)
                    held, peak = 0.0, 0.0
                    for _, kind, mb, _ in strategy._pipeline.actions:
                        size = float(sum(self.by_microbatch.get(mb, {}).values()))
                        held += size if kind == "F" else -size
                        peak = max(peak, held)
                    counted["activations"] = peak
            if layout in PIPELINES and trainer.global_step > 2:
                bubbles.append(trainer.strategy.pipeline_bubble)
                steady.append(trainer.strategy._pipeline.bubble(steady=True))

    step_times: list[float] = []

    class Times(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            import time

            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            import time

            step_times.append(time.perf_counter() - self.start)

    report = RunReport(warmup_steps=2, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, limit_val_batches=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[report, OneStep(), Times()])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, datamodule=data)
    import statistics

    sent = torch.tensor([float(counted.get(k, 0.0)) for k in ("bytes", "collectives", "activations")])
    gathered = trainer.strategy.all_gather(sent).reshape(-1, 3).tolist()
    plan = getattr(trainer.strategy, "tensor_parallel_plan", None)
    fraction = None
    if plan is not None:
        from lightning_bigtrain.functional.tensor_parallel import sharded_fraction

        fraction = sharded_fraction(model, plan)
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps({
            "layout": layout, "psi": psi, "devices": devices, "degree": degree,
            "model_state_bytes_per_rank": report.report["model_state_bytes_per_rank"],
            "tp_bytes_per_rank": [row[0] for row in gathered], "tp_collectives_per_rank": [row[1] for row in gathered],
            "activation_bytes_per_rank": [row[2] for row in gathered],
            "step_seconds_median": statistics.median(step_times[2:]), "step_seconds": step_times,
            "loss_end": report.report["train_loss_end"], "sharded_fraction": fraction,
            "bubble_median": statistics.median(bubbles) if bubbles else None, "bubbles": bubbles,
            "steady_bubble_median": statistics.median(steady) if steady else None,
        }))  # fmt: skip


def _throughput(entry: dict[str, Any]) -> float:
    """Tokens per second over the job: one batch per data-parallel rank per step (a pipeline is one such rank)."""
    replicas = 1 if entry["layout"] in PIPELINES else entry["devices"] // entry["degree"]
    return replicas * BATCH * BLOCK / entry["step_seconds_median"]


def _planner(layout: str, quick: bool) -> dict[str, float]:
    import torch

    from benchmarks.common import zero_benchmark_model
    from lightning_bigtrain.planning import plan
    from lightning_bigtrain.planning.parallel import estimate_pipeline, estimate_tensor_parallel

    devices, degree = LAYOUTS[layout]
    _, model, _ = zero_benchmark_model(quick)
    rows = plan(model, devices=devices, accelerator="cpu", batch_shape=(BATCH, BLOCK), optimizer="adamw",
                compression=False)  # fmt: skip
    if layout in PIPELINES:  # the row is 1F1B's; the schedule's activations and bubble from its estimate
        row = rows["zero3_pp2"]
        est = estimate_pipeline(model, 2, 2, torch.zeros(BATCH, BLOCK, dtype=torch.long), schedule=PIPELINES[layout])
        return {"model_state_bytes": row.model_states_bytes, "comm_bytes_per_step": row.comm_bytes_per_step,
                "activation_bytes": max(est.activations(r) or 0.0 for r in range(2)), "bubble": est.bubble}  # fmt: skip
    row = rows["ddp" if degree == 1 else f"zero3_tp{degree}"]
    out = {"model_state_bytes": row.model_states_bytes, "comm_bytes_per_step": row.comm_bytes_per_step,
           "activation_bytes": row.activation_bytes}  # fmt: skip
    if degree > 1:
        est = estimate_tensor_parallel(model, degree, devices, torch.zeros(BATCH, BLOCK, dtype=torch.long))
        out["tp_bytes_per_step"] = est.tensor_parallel_bytes(4)
        out["tp_collectives"] = len(est.messages)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.quick, args.steps, args.out)
        return {}
    flags = ["--steps", str(args.steps)] + (["--quick"] if args.quick else [])
    figures: dict[str, Any] = {}
    for layout in LAYOUTS:
        measured = run_worker("benchmarks.parallel", ["--worker", layout, *flags])
        predicted = _planner(layout, args.quick)
        entry = {**measured, "planner": predicted}
        if layout != "dp2_tp2":  # FSDP2's gathered weights are not parameters to the count: no figure there
            entry["activations_over_planner"] = ratio(max(measured["activation_bytes_per_rank"]),
                                                      predicted["activation_bytes"])  # fmt: skip
        if layout != "ddp":
            states = max(measured["model_state_bytes_per_rank"])
            entry["states_over_planner"] = ratio(states, predicted["model_state_bytes"])
        if layout in PIPELINES:
            entry["pp_bytes_over_planner"] = ratio(max(measured["tp_bytes_per_rank"]), predicted["comm_bytes_per_step"])
            entry["bubble_over_planner"] = ratio(measured["bubble_median"], predicted["bubble"])
        elif layout != "ddp":
            entry["tp_bytes_over_planner"] = ratio(max(measured["tp_bytes_per_rank"]), predicted["tp_bytes_per_step"])
        figures[layout] = entry
        print(f"{layout}: states {max(measured['model_state_bytes_per_rank']) / 2**20:.2f} MiB per rank, "
              f"step {1e3 * measured['step_seconds_median']:.0f} ms", flush=True)  # fmt: skip
    for name in ("tp2", *PIPELINES):
        figures[name]["throughput_over_ddp"] = ratio(_throughput(figures[name]), _throughput(figures["ddp"]))
    rows = [
        {
            "layout": k,
            "states MiB/rank": max(v["model_state_bytes_per_rank"]) / 2**20,
            "planner MiB": v["planner"]["model_state_bytes"] / 2**20,
            "TP/PP MiB/step": max(v["tp_bytes_per_rank"]) / 2**20,
            "planner MiB/step": v["planner"].get("tp_bytes_per_step", v["planner"]["comm_bytes_per_step"]) / 2**20,
            "bubble": v.get("bubble_median") or 0.0,
            "planner bubble": v["planner"].get("bubble", 0.0),
            "activations MiB": max(v["activation_bytes_per_rank"]) / 2**20,
            "planner act. MiB": v["planner"]["activation_bytes"] / 2**20,
            "step ms": 1e3 * v["step_seconds_median"],
            "tokens/s": _throughput(v),
        }
        for k, v in figures.items()
    ]
    table = print_table(rows, list(rows[0]))
    tp2, pp2 = figures["tp2"], figures["pp2"]
    headline = (f"tp2 states x{tp2['states_over_planner']:.3f} planner, TP bytes x{tp2['tp_bytes_over_planner']:.3f} "
                f"planner, throughput x{tp2['throughput_over_ddp']:.2f} DDP; pp2 (1F1B) bubble "
                f"{pp2['bubble_median']:.3f} (planner {pp2['planner']['bubble']:.3f}), PP bytes "
                f"x{pp2['pp_bytes_over_planner']:.3f} planner, "
                f"throughput x{pp2['throughput_over_ddp']:.2f} DDP")  # fmt: skip
    payload = {"config": {"quick": args.quick, "steps": args.steps, "batch": [BATCH, BLOCK], "layouts": LAYOUTS},
               "figures": figures, "table": table}  # fmt: skip
    path = write_results("parallel", payload, headline, args.results_dir,
                         command=command_line("benchmarks.parallel", argv))  # fmt: skip
    print(f"wrote {path}")
    return figures


def _steady(pp2: dict[str, Any]) -> str:
    """The bubble replayed at each stage's median action times, where the results have it."""
    steady = pp2.get("steady_bubble_median")
    if steady is None:
        return (
            "on 2 shared cores an action that runs while the other rank idles gets both cores, and shrinks the bubble."
        )
    ratio_ = steady / pp2["planner"]["bubble"]
    return (
        "at each stage's median time per kind of action (on 2 shared cores an action that runs while the other rank "
        f"idles gets both cores, and shrinks the bubble it sits in) it is **{steady:.3f}**, x{ratio_:.2f} the "
        "planner's, whose formula assumes equal stages (the last one here also runs the head and the loss)."
    )


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``parallel`` block (docs/parallel.md), from ``results/parallel.json``."""
    from benchmarks.common import load_results, measured_line

    results = load_results(results_dir, "parallel.json")
    f = results["figures"]
    psi = f["tp2"]["psi"]
    rows = []
    for name, v in f.items():
        p = v["planner"]
        predicted = p.get("tp_bytes_per_step", p["comm_bytes_per_step"])
        tp = "-" if name == "ddp" else f"{max(v['tp_bytes_per_rank']) / 2**20:.2f} ({predicted / 2**20:.2f})"
        bubble = f"{v['bubble_median']:.3f} ({p['bubble']:.3f})" if name in PIPELINES else "-"
        step = "- | -" if name == "dp2_tp2" else f"{1e3 * v['step_seconds_median']:.0f} | {_throughput(v):.0f}"
        act = (
            "-"
            if name == "dp2_tp2"
            else f"{max(v['activation_bytes_per_rank']) / 2**20:.2f} ({p['activation_bytes'] / 2**20:.2f})"
        )
        rows.append(
            f"| {name} | {max(v['model_state_bytes_per_rank']) / 2**20:.2f} ({p['model_state_bytes'] / 2**20:.2f}) "
            f"| {act} | {tp} | {bubble} | {step} |"
        )
    tp2, pp2, gpipe = f["tp2"], f["pp2"], f["pp2_gpipe"]
    return "\n".join(
        [
            measured_line(results, "parallel.json", results_dir),
            "",
            f"Char-GPT of {psi / 1e6:.1f}M parameters, batch {BATCH} x {BLOCK} per data-parallel rank, fp32 AdamW, "
            f"CPU over gloo. Under `tensor_parallel=2` the automatic split covers "
            f"**{100 * tp2['sharded_fraction']:.1f}%** of the blocks' parameters. Per rank, measured (planner):",
            "",
            "| layout | model states MiB | activations MiB | TP / PP MiB sent per step | bubble | step ms | tokens/s |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"Model states **x{tp2['states_over_planner']:.3f}** the planner's, tensor-parallel bytes "
            f"**x{tp2['tp_bytes_over_planner']:.3f}** (tp2); `dp2_tp2` x{f['dp2_tp2']['states_over_planner']:.3f} and "
            f"x{f['dp2_tp2']['tp_bytes_over_planner']:.3f}. Activations (bytes the forward saves for backward, this "
            f"rank's distinct storages, weights excluded) **x{tp2['activations_over_planner']:.2f}** the planner's at "
            f"tp2 (DDP's x{f['ddp']['activations_over_planner']:.2f}); under `dp2_tp2` FSDP2's gathered weights are "
            "not parameters to that count, so it has no activation figure. Throughput of tp2 "
            f"**x{tp2['throughput_over_ddp']:.2f}** DDP's on this 2-core CPU, at the same batch per data-parallel rank "
            "(DDP's two ranks train on two batches per step, the pair on one: here tensor parallelism buys memory, "
            "not speed; each rank computes half of every block but waits on four blocking all-reduces per block, and "
            "DTensor's dispatch adds a fixed cost per split module). `dp2_tp2` runs 4 processes on 2 cores, so its "
            "time is not a figure.",
            "",
            f"Pipeline (`pp2`: 1F1B, `pp2_gpipe`: GPipe; 2 stages, each batch cut into {BATCH} micro-batches of 1 "
            "sequence): model states "
            f"**x{pp2['states_over_planner']:.3f}** the planner's, bytes sent (activations and gradients between the "
            f"stages, and the sum of the embeddings' and head's gradients) **x{pp2['pp_bytes_over_planner']:.3f}**, "
            f"activations held at the peak (each micro-batch's saved bytes from its forward to its backward, in the "
            f"order the rank ran them) **x{pp2['activations_over_planner']:.2f}** under 1F1B and "
            f"x{gpipe['activations_over_planner']:.2f} under GPipe, which holds every micro-batch. The bubble is "
            "replayed from the schedule's own per-action times (each forward and backward timed where the stage runs "
            f"it; the wall clock of 2 ranks on 2 cores measures the OS): **{pp2['bubble_median']:.3f}** against the "
            f"planner's {pp2['planner']['bubble']:.3f} (x{pp2['bubble_over_planner']:.2f}); "
            + _steady(pp2)
            + " Throughput "
            f"**x{pp2['throughput_over_ddp']:.2f}** DDP's (one pipeline trains on one batch per step, DDP's two ranks "
            "on two).",
        ]
    )


if __name__ == "__main__":
    main()
