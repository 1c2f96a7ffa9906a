"""RandAugment on a batch: our per-sample operations against torchvision v2's and kornia's, time per batch.

    python -m benchmarks.randaugment [--repeats 30] [--quick]

Each implementation augments the same float batch (pixels in [0, 1]) with 2 operations at magnitude 9, one process,
2 threads, on three shapes: Fashion-MNIST's (128 x 1 x 28 x 28), CIFAR's (64 x 3 x 32 x 32) and ImageNet's
(16 x 3 x 224 x 224). Measured: the median wall time of one batch over ``--repeats`` batches (after 5 warm-up
batches), the implementations alternating.

- ``ours``: ``lightning_bigtrain.functional.augmentation.rand_augment`` (each sample its own operations and signs);
- ``torchvision_batch``: ``torchvision.transforms.v2.RandAugment()`` called on the batch: one set of operations
  and one magnitude sign for the whole batch;
- ``torchvision_per_sample``: the same transform called on each sample in turn (what per-sample operations cost
  with torchvision);
- ``kornia`` (when installed): ``kornia.augmentation.auto.RandAugment(n=2, m=9)`` on the batch (its operations
  are drawn once per batch).

This is the choice issue 24 asks for ("prefer a kept library for the ops where one fits; measure it against plain
torch"): what per-sample operations cost in each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, alternate, command_line, machine_info, print_table, times, write_results

SHAPES = {"fashion_mnist": (128, 1, 28, 28), "cifar": (64, 3, 32, 32), "imagenet": (16, 3, 224, 224)}


def _candidates() -> dict[str, Any]:
    import numpy as np
    import torch
    from torchvision.transforms import v2

    from lightning_bigtrain.functional.augmentation import rand_augment

    rng = np.random.default_rng(0)
    tv = v2.RandAugment(num_ops=2, magnitude=9)
    made: dict[str, Any] = {
        "ours": lambda x: rand_augment(x, rng, num_ops=2, magnitude=9),
        "torchvision_batch": tv,
        "torchvision_per_sample": lambda x: torch.stack([tv(s) for s in x]),
    }
    try:
        from kornia.augmentation.auto import RandAugment

        kornia = RandAugment(n=2, m=9)
        made["kornia"] = kornia
    except ImportError:
        pass
    return made


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="5 repeats (a smoke run)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    repeats = 5 if args.quick else args.repeats
    impls = _candidates()
    figures: dict[str, Any] = {"shapes": {}}
    rows = []
    for shape_name, shape in SHAPES.items():
        x = torch.rand(*shape, generator=torch.Generator().manual_seed(0))

        failed: dict[str, str] = {}  # an implementation that raises on this shape (at any draw) is recorded as such

        def timed(name: str, fn: Any, x: Any = x, failed: dict[str, str] = failed) -> Any:
            def run() -> float | None:
                t0 = time.perf_counter()
                try:
                    fn(x)
                except (ValueError, RuntimeError) as err:
                    failed.setdefault(name, f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
                    return None
                return time.perf_counter() - t0

            return run

        for name, fn in impls.items():  # warm-up
            for _ in range(5):
                timed(name, fn)()
        times = alternate({name: timed(name, fn) for name, fn in impls.items()}, repeats)
        for name, error in failed.items():
            print(f"{name} on {tuple(shape)}: {error}")
        times = {name: t for name, t in times.items() if name not in failed}
        medians = {name: statistics.median(t) for name, t in times.items()}
        figures["shapes"][shape_name] = {"shape": list(shape), "median_s": medians, "times_s": times,
                                         "failed": failed}  # fmt: skip
        for name, m in medians.items():
            rows.append({"shape": "x".join(map(str, shape)), "implementation": name, "ms per batch": 1000 * m,
                         "vs ours": m / medians["ours"]})  # fmt: skip
    figures["table"] = print_table(rows, list(rows[0]))
    fm = figures["shapes"]["fashion_mnist"]["median_s"]
    headline = (f"per-sample RandAugment {fm['torchvision_per_sample'] / fm['ours']:.1f}x faster than torchvision per "
                f"sample, {fm['ours'] / fm['torchvision_batch']:.2f}x torchvision per batch (128x1x28x28)")  # fmt: skip
    config: dict[str, Any] = {"quick": args.quick, "repeats": repeats, "num_ops": 2, "magnitude": 9,
                              "implementations": list(impls)}  # fmt: skip
    try:
        import kornia

        config["kornia"] = kornia.__version__
    except ImportError:
        pass
    payload = {"config": config, "machine": machine_info(), "figures": figures}
    path = write_results("randaugment", payload, headline, args.results_dir,
                         command=command_line("benchmarks.randaugment", argv))  # fmt: skip
    print(f"wrote {path}")
    return figures


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``randaugment`` block (docs/augmentation.md), from ``results/randaugment.json``."""
    from benchmarks.common import load_results, measured_line

    results = load_results(results_dir, "randaugment.json")
    f, c = results["figures"], results["config"]
    names = {"ours": "ours (operations per sample)", "torchvision_batch": "torchvision v2, on the batch (one set)",
             "torchvision_per_sample": "torchvision v2, sample by sample",
             "kornia": f"kornia {c.get('kornia', '')}, on the batch (one set)"}  # fmt: skip
    shapes = list(f["shapes"])
    lines = [
        measured_line(results, "randaugment.json", results_dir),
        "",
        f"RandAugment, {c['num_ops']} operations at magnitude {c['magnitude']}, one process, 2 threads; the median "
        f"time of one batch over {c['repeats']} batches, in ms (and over ours); an implementation that raised on a "
        "shape is marked (the error is in the results file).",
        "",
        "| implementation | " + " | ".join("x".join(map(str, f["shapes"][s]["shape"])) for s in shapes) + " |",
        "|---|" + "---|" * len(shapes),
    ]
    for name in c["implementations"]:
        cells = []
        for s in shapes:
            m = f["shapes"][s]["median_s"]
            if name not in m:
                cells.append("refused the input")
            else:
                cells.append(f"{1000 * m[name]:.2f}" + ("" if name == "ours" else f" ({times(m[name] / m['ours'])})"))
        lines.append(f"| {names.get(name, name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
