"""BatchAugmentation on the Fashion-MNIST CNN: test accuracy and step time against no augmentation and against
torchvision v2's batch MixUp/CutMix, in the same run.

    python -m benchmarks.augmentation [--seeds 3] [--steps 600] [--quick]

Three configurations of the same ``FashionCNN`` (channels 16/32/64, AdamW, batch 128), each trained for the same
number of steps on the full training split and scored on the test split, one process each, 3 seeds:

- ``none``: no augmentation;
- ``ours``: ``BatchAugmentation(mixup=0.2, cutmix=1.0, num_classes=10)`` (each sample its own weight, box and
  choice between the two);
- ``torchvision``: ``v2.RandomChoice([v2.CutMix(alpha=1.0), v2.MixUp(alpha=0.2)])`` applied to the batch in the
  module's ``on_after_batch_transfer`` (the same place; one weight and box per batch, as torchvision draws).

Step time: the median over the run of each training step's wall time (batch transfer, augmentation, forward,
backward, optimizer), steps after the first 20; the seeds alternate the order of the configurations. Target
(issue 24): ours not worse than torchvision's beyond the seed spread, and at most 1.1x the step time of ``none``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, command_line, machine_info, print_table, run_worker, write_results

METHODS = ("none", "ours", "torchvision")
CHANNELS = (16, 32, 64)  # FashionCNN's conv stages: a quarter of the default's width (a run is a few minutes)


def worker(method: str, seed: int, steps: int, out: str) -> None:
    import lightning as L
    import torch

    from benchmarks.common import set_flush_denormal
    from lightning_bigtrain.callbacks import BatchAugmentation
    from lightning_bigtrain.data import FashionMNISTDataModule
    from lightning_bigtrain.models import FashionCNN

    set_flush_denormal()
    torch.set_num_threads(2)
    L.seed_everything(seed, verbose=False)
    times: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            times.append(time.perf_counter() - self.t0)

    class TorchvisionCNN(FashionCNN):
        """torchvision v2's batch MixUp/CutMix where its documentation puts it: on the batch, after loading."""

        def __init__(self) -> None:
            super().__init__(channels=CHANNELS)
            from torchvision.transforms import v2

            self.mix = v2.RandomChoice([v2.CutMix(alpha=1.0, num_classes=10), v2.MixUp(alpha=0.2, num_classes=10)])

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            return self.mix(*batch) if self.trainer.training else batch

    model = TorchvisionCNN() if method == "torchvision" else FashionCNN(channels=CHANNELS)
    callbacks: list[Any] = [Clock()]
    if method == "ours":
        callbacks.insert(0, BatchAugmentation(mixup=0.2, cutmix=1.0, num_classes=10))
    data = FashionMNISTDataModule(batch_size=128, seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                        limit_val_batches=0, num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(model, datamodule=data)
    test = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    acc = test.test(model, datamodule=data, verbose=False)[0]["test_acc"]
    Path(out).write_text(json.dumps({"test_acc": acc, "step_s": statistics.median(times[20:]), "steps": len(times)}))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600, help="training steps per run (default 600, 1.3 epochs)")
    parser.add_argument("--quick", action="store_true", help="1 seed, 60 steps (a smoke run)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.seed, args.steps, args.out)
        return {}
    steps = 60 if args.quick else args.steps
    seeds = list(range(1 if args.quick else args.seeds))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for seed in seeds:
        order = METHODS if seed % 2 == 0 else METHODS[::-1]
        for method in order:
            r = run_worker("benchmarks.augmentation", ["--worker", method, "--seed", str(seed), "--steps", str(steps)])
            runs[method].append(r)
            print(f"seed {seed} {method}: test acc {r['test_acc']:.4f}, step {1000 * r['step_s']:.2f} ms", flush=True)
    figures: dict[str, Any] = {"steps": steps, "seeds": seeds, "methods": {}}
    none_step = statistics.fmean(r["step_s"] for r in runs["none"])
    rows = []
    for method in METHODS:
        accs = [r["test_acc"] for r in runs[method]]
        step = statistics.fmean(r["step_s"] for r in runs[method])
        entry = {"test_acc": accs, "mean": statistics.fmean(accs), "min": min(accs), "max": max(accs),
                 "step_s": [r["step_s"] for r in runs[method]], "step_vs_none": step / none_step}  # fmt: skip
        figures["methods"][method] = entry
        rows.append({"method": method, "test acc": entry["mean"], "min..max": f"{min(accs):.4f}..{max(accs):.4f}",
                     "step ms": 1000 * step, "step vs none": entry["step_vs_none"]})  # fmt: skip
    ours, tv = figures["methods"]["ours"], figures["methods"]["torchvision"]
    figures["ours_minus_torchvision_points"] = 100 * (ours["mean"] - tv["mean"])
    print(f"\nFashion-MNIST CNN, {steps} steps, batch 128, {len(seeds)} seed(s)")
    figures["table"] = print_table(rows, list(rows[0]))
    headline = (f"ours {100 * ours['mean']:.2f}% vs torchvision {100 * tv['mean']:.2f}% vs none "
                f"{100 * figures['methods']['none']['mean']:.2f}%; step {ours['step_vs_none']:.3f}x none")  # fmt: skip
    payload = {"config": {"quick": args.quick, "steps": steps, "seeds": seeds}, "machine": machine_info(),
               "figures": figures}  # fmt: skip
    path = write_results("augmentation", payload, headline, args.results_dir,
                         command=command_line("benchmarks.augmentation", argv))  # fmt: skip
    print(f"wrote {path}")
    return figures


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``augmentation`` block (docs/augmentation.md), from ``results/augmentation.json``."""
    from benchmarks.common import load_results, measured_line

    results = load_results(results_dir, "augmentation.json")
    f = results["figures"]
    seeds = len(f["seeds"])
    lines = [
        measured_line(results, "augmentation.json", results_dir),
        "",
        f"Fashion-MNIST CNN (conv channels {'/'.join(map(str, CHANNELS))}), {f['steps']} steps at batch 128 (one "
        f"process, AdamW), test accuracy over {seeds} seed"
        f"{'s' if seeds > 1 else ''} (mean, min..max); step time: the median step, averaged over the seeds, over "
        "the same with no augmentation.",
        "",
        "| augmentation | test accuracy | min..max | step time vs none |",
        "|---|---|---|---|",
    ]
    labels = {"none": "none", "ours": "`BatchAugmentation(mixup=0.2, cutmix=1.0, num_classes=10)`",
              "torchvision": "torchvision v2 `RandomChoice([CutMix(1.0), MixUp(0.2)])`"}  # fmt: skip
    for method in METHODS:
        m = f["methods"][method]
        lines.append(f"| {labels[method]} | {100 * m['mean']:.2f}% | {100 * m['min']:.2f}..{100 * m['max']:.2f}% | "
                     f"{m['step_vs_none']:.3f}x |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
