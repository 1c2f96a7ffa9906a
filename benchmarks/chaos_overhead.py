"""What checkpointing costs a ZeRO-3 run: sync vs async sharded saves, against no checkpoints (the peer).

    python -m benchmarks.chaos --parts overhead [--quick] [--repeats N]

The 25M-parameter char-GPT of ``benchmarks/zero.py`` (8 layers, width 512; ``--quick``: 2 layers, width 128) on
Shakespeare under ``ZeroStrategy(stage=3)``, 2 CPU ranks, fp32 AdamW. Three variants, each in its own process
tree, alternating over rounds: no checkpoint; ``ModelCheckpoint(every_n_train_steps=10, save_top_k=0,
save_last=True)`` with synchronous sharded saves; the same with ``ZeroOptions(async_checkpoint=True)``. The
figure is the mean wall time per step over the steps after the first two (checkpoint steps included: a median
would hide them), as a ratio to the variant without checkpoints; the last async save is waited for (and
counted) at the end of training.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import alternate, print_table, ratio, run_worker, summarize

VARIANTS = ("none", "sync", "async")
EVERY = 10


def worker(variant: str, steps: int, quick: bool, out: str) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from benchmarks.common import zero_benchmark_model
    from lightning_bigtrain.strategies import ZeroOptions, ZeroStrategy

    data, model, psi = zero_benchmark_model(quick)
    strategy = ZeroStrategy(stage=3, options=ZeroOptions(async_checkpoint=variant == "async"))

    class Clock(L.Callback):
        """Wall time from the start of the third batch to the end of training (the last commit included)."""

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2 and not hasattr(self, "start"):
                self.start = time.perf_counter()

    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        callbacks: list[Any] = [clock]
        if variant != "none":
            callbacks.append(ModelCheckpoint(dirpath=tmp, every_n_train_steps=EVERY, save_top_k=0, save_last=True))
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, limit_val_batches=0,
                            logger=False, enable_checkpointing=variant != "none", enable_progress_bar=False,
                            enable_model_summary=False, callbacks=callbacks)  # fmt: skip
        trainer.fit(model, datamodule=data)
        seconds = time.perf_counter() - clock.start  # the strategy's on_train_end waited for the last commit
        if trainer.is_global_zero:
            saved = sorted(p.name for p in Path(tmp).iterdir())
            Path(out).write_text(json.dumps({"step_seconds": seconds / (steps - 2), "psi": psi, "files": saved}))


def overhead(quick: bool, repeats: int) -> dict[str, Any]:
    steps = 22 if quick else 42
    extra = ["--quick"] if quick else []

    def run(variant: str) -> dict[str, Any]:
        return run_worker("benchmarks.chaos_overhead", ["--worker", variant, "--steps", str(steps), *extra])

    run("none")  # warm-up, discarded (cold file cache and imports)
    measured = alternate({v: (lambda v=v: run(v)) for v in VARIANTS}, repeats)
    times = {v: summarize([r["step_seconds"] for r in measured[v]]) for v in VARIANTS}
    psi = measured["none"][0]["psi"]
    rows = [{"variant": v, "step s (mean)": times[v]["median"], "over none": ratio(times[v]["median"],
             times["none"]["median"])} for v in VARIANTS]  # fmt: skip
    print(f"\nCheckpoint overhead, ZeRO-3 char-GPT {psi / 1e6:.1f}M params, a checkpoint every {EVERY} steps, "
          f"{steps} steps, 2 CPU ranks ({repeats} rounds, medians of the per-run mean step)")  # fmt: skip
    table = print_table(rows, list(rows[0]))
    return {
        "every": EVERY,
        "steps": steps,
        "psi": psi,
        "repeats": repeats,
        "step_seconds": times,
        "sync_ratio": ratio(times["sync"]["median"], times["none"]["median"]),
        "async_ratio": ratio(times["async"]["median"], times["none"]["median"]),
        "files": measured["async"][0]["files"],
        "table": table,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", choices=VARIANTS, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    worker(args.worker, args.steps, args.quick, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
