"""Pruning: accuracy at 50/80/90% sparsity vs Lightning's ModelPruning, and the real speed-up of structured pruning.

Fashion-MNIST, one process, 2 threads, same steps for every run (4 epochs of 150 batches of 128 images).
- Unstructured: ``MagnitudePruning(s)`` (global magnitude, Zhu & Gupta's cubic ramp to 3/4 of the run, then
  fine-tuning) vs ``lightning.pytorch.callbacks.ModelPruning("l1_unstructured", use_global_unstructured=True)``
  pruning at the end of epochs 1-3 along the same cubic curve (its schedule is per epoch), on the same Conv and
  Linear weights, vs the dense model; test accuracy.
- Structured: ``StructuredPruning(0.5)`` (half of every prunable channel group removed along the same ramp, then
  fine-tuning) on the CNN and on an MLP (784-1024-1024-10); CPU inference latency (batch 256, medians of
  alternating rounds), FLOPs (``torch.utils.flop_counter``) and parameters as ratios to dense, and test
  accuracy. The peer, ``ModelPruning("ln_structured", amount=0.5)``, masks whole filters but keeps the dense
  shapes: its latency is measured the same way.
- 2:4: ``MagnitudePruning(pattern="2:4")`` from the middle of the run (dense before), compliance and accuracy.
- torchvision's ResNet-18 (first convolution taking 1 channel): the unstructured comparison, 4 epochs of 75
  batches (a ResNet-18 step costs about ten CNN steps here).

- Structured sweep: Taylor importance, a shorter ramp, and the half-width CNN trained from scratch (capacity).

    python -m benchmarks.pruning [--quick] [--parts cnn resnet18 structured_sweep]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    command_line,
    merge_runs,
    print_table,
    provenance,
    ratio,
    set_flush_denormal,
    write_results,
)

SPARSITIES = (0.5, 0.8, 0.9)
PARTS = ("cnn", "resnet18", "structured_sweep")
CNN_NM_PARAMS = ["features.4.weight", "features.8.weight", "classifier.weight"]  # the first conv has 9 inputs


def _classifier(net: Any) -> Any:
    """A LightningModule around ``net`` (images -> 10 logits): cross-entropy, AdamW at 1e-3, test accuracy."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torchmetrics.classification import MulticlassAccuracy

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.test_acc = MulticlassAccuracy(10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self(x), y)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.test_acc(self(x), y)
            self.log("test_acc", self.test_acc)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Classifier()


def _mlp() -> Any:
    from torch import nn

    return _classifier(nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                     nn.Linear(1024, 10)))  # fmt: skip


def _cubic_epochs(final: float, epochs: int) -> list[float]:
    """Cumulative sparsity after each epoch on the cubic ramp ending 3/4 through the run (ModelPruning's grid)."""
    from lightning_bigtrain.functional.pruning import cubic_sparsity

    end = round(0.75 * epochs)
    return [cubic_sparsity(e + 1, final=final, start=0, end=end) for e in range(epochs)]


def _model_pruning(kind: str, final: float, epochs: int, model: Any) -> Any:
    from lightning.pytorch.callbacks import ModelPruning
    from torch import nn

    targets = [(m, "weight") for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    if kind == "unstructured":
        cumulative = _cubic_epochs(final, epochs)

        def amount(epoch: int) -> float:
            # torch.nn.utils.prune takes the fraction of the *remaining* weights to prune.
            before = cumulative[epoch - 1] if epoch > 0 else 0.0
            return 0.0 if cumulative[epoch] <= before else 1 - (1 - cumulative[epoch]) / (1 - before)

        return ModelPruning("l1_unstructured", amount=amount, parameters_to_prune=targets,
                            use_global_unstructured=True, verbose=0)  # fmt: skip
    outputs = [(m, "weight") for m, _ in targets if not (isinstance(m, nn.Linear) and m.out_features == 10)]
    cumulative = _cubic_epochs(final, epochs)

    def amount_structured(epoch: int) -> float:
        before = cumulative[epoch - 1] if epoch > 0 else 0.0
        return 0.0 if cumulative[epoch] <= before else 1 - (1 - cumulative[epoch]) / (1 - before)

    return ModelPruning("ln_structured", amount=amount_structured, parameters_to_prune=outputs, pruning_dim=0,
                        pruning_norm=2, use_global_unstructured=False, verbose=0)  # fmt: skip


def _fit(model: Any, callbacks: list[Any], args: argparse.Namespace) -> tuple[float, float]:
    import lightning as L

    from lightning_bigtrain.data import FashionMNISTDataModule

    data = FashionMNISTDataModule(batch_size=128, seed=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=args.epochs, limit_train_batches=args.batches,
                        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, num_sanity_val_steps=0)  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_test_batches=args.test_batches)  # fmt: skip
    return float(trainer.test(model, datamodule=data, verbose=False)[0]["test_acc"]), seconds


def _sparsity(model: Any) -> float:
    from torch import nn

    weights = [m.weight for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    return sum(int((w == 0).sum()) for w in weights) / sum(w.numel() for w in weights)


def _latency(models: dict[str, Any], rounds: int, batch: int = 256) -> dict[str, float]:
    """Median seconds per forward of a batch, in alternating rounds (order flipped every round)."""
    import torch

    x = torch.randn(batch, 1, 28, 28)
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        for m in models.values():
            m.eval()
            for _ in range(3):
                m(x)
        names = list(models)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                for _ in range(5):
                    models[name](x)
                times[name].append((time.perf_counter() - start) / 5)
    return {name: statistics.median(t) for name, t in times.items()}


def _flops(model: Any) -> int:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model.eval()(torch.randn(1, 1, 28, 28))
    return counter.get_total_flops()


def _params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def _resnet18() -> Any:
    """torchvision's ResNet-18 with its first convolution taking 1 channel (its 7x7/2 stem and max-pool kept:
    28x28 images reach the residual stages at 7x7)."""
    import torchvision
    from torch import nn

    net = torchvision.models.resnet18(num_classes=10)
    net.conv1 = nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return _classifier(net)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few steps (a smoke run; figures meaningless)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="what to run; the other parts' figures are kept from the last results file")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batches", type=int, default=150, help="training batches per epoch (CNN, MLP)")
    parser.add_argument("--resnet-batches", type=int, default=75, help="training batches per epoch (ResNet-18)")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.batches, args.resnet_batches = 4, 3, 2
    args.test_batches = 2 if args.quick else 1.0

    import json

    import lightning as L
    import torch

    from lightning_bigtrain.callbacks import MagnitudePruning, PruningSchedule, StructuredPruning
    from lightning_bigtrain.models import FashionCNN

    set_flush_denormal()
    torch.set_num_threads(2)
    figures: dict[str, Any] = {}
    previous = args.results_dir / "pruning.json"
    kept: dict[str, Any] | None = None
    if set(args.parts) != set(PARTS) and previous.exists():
        kept = json.loads(previous.read_text())
        figures.update(kept["figures"])
        print(f"kept the figures of the parts not run from {previous}")
    command = command_line("benchmarks.pruning", argv)
    runs = merge_runs(kept, args.parts, provenance(command))
    figures["config"] = {"epochs": args.epochs, "batches_per_epoch": {"cnn": args.batches, "mlp": args.batches,
                         "resnet18": args.resnet_batches}, "batch_size": 128, "threads": 2, "seed": 0}  # fmt: skip

    def run(name: str, build: Any, callbacks: Any, batches: int | None = None) -> tuple[Any, dict[str, Any]]:
        L.seed_everything(0, verbose=False)
        model = build()
        run_args = argparse.Namespace(**{**vars(args), "batches": batches or args.batches})
        acc, seconds = _fit(model, callbacks(model), run_args)
        out = {"test_acc": acc, "sparsity": _sparsity(model), "params": _params(model), "fit_s": seconds}
        print(f"{name}: {out}", flush=True)
        figures[name] = out
        return model, out

    def unstructured(model_name: str, build: Any, batches: int) -> Any:
        dense_model, _ = run(f"{model_name}_dense", build, lambda m: [], batches)
        for s in SPARSITIES:
            run(f"{model_name}_magnitude_{s}", build, lambda m, s=s: [MagnitudePruning(s, plot=False)], batches)
            run(f"{model_name}_modelpruning_{s}", build,
                lambda m, s=s: [_model_pruning("unstructured", s, args.epochs, m)], batches)  # fmt: skip
        return dense_model

    if "cnn" in args.parts:
        dense_cnn = unstructured("cnn", FashionCNN, args.batches)
        nm_pruning = dict(pattern="2:4", schedule=PruningSchedule(start=0.5), parameters=CNN_NM_PARAMS, plot=False)
        run("cnn_2of4", FashionCNN, lambda m: [MagnitudePruning(**nm_pruning)])
        for model_name, build in (("cnn", FashionCNN), ("mlp", _mlp)):
            dense_model = dense_cnn if model_name == "cnn" else run("mlp_dense", build, lambda m: [])[0]
            pruned, _ = run(f"{model_name}_structured_0.5", build, lambda m: [StructuredPruning(0.5)])
            models = {"dense": dense_model, "ours": pruned}
            if model_name == "cnn":
                peer = lambda m: [_model_pruning("structured", 0.5, args.epochs, m)]  # noqa: E731
                models["ModelPruning"], _ = run("cnn_modelpruning_structured_0.5", build, peer)
            latency = _latency(models, rounds=5 if args.quick else 30)
            flops = {name: _flops(m) for name, m in models.items()}
            figures[f"{model_name}_structured_summary"] = {"latency_s": latency, "flops": flops}
    if "resnet18" in args.parts:
        unstructured("resnet18", _resnet18, args.resnet_batches)
    if "structured_sweep" in args.parts:
        # Settings a user would try when StructuredPruning(0.5) costs accuracy, and the capacity reference: the CNN
        # with half the channels trained from scratch for the same steps.
        run("cnn_structured_0.5_taylor", FashionCNN, lambda m: [StructuredPruning(0.5, importance="taylor")])
        early = PruningSchedule(end=0.5)
        run("cnn_structured_0.5_end0.5", FashionCNN, lambda m: [StructuredPruning(0.5, schedule=early)])
        run("cnn_half_width_scratch", lambda: FashionCNN(channels=(16, 32, 64)), lambda m: [])

    rows = []
    for model_name in ("cnn", "resnet18"):
        if f"{model_name}_dense" not in figures:
            continue
        dense = figures[f"{model_name}_dense"]["test_acc"]
        for s in SPARSITIES:
            ours, peer = figures[f"{model_name}_magnitude_{s}"], figures[f"{model_name}_modelpruning_{s}"]
            rows.append({"model": model_name, "method": f"unstructured {s:.0%}", "ours acc": ours["test_acc"],
                         "ModelPruning acc": peer["test_acc"], "dense acc": dense,
                         "ours - dense (pts)": 100 * (ours["test_acc"] - dense),
                         "peer - dense (pts)": 100 * (peer["test_acc"] - dense),
                         "ours sparsity": ours["sparsity"], "peer sparsity": peer["sparsity"]})  # fmt: skip
        if model_name == "cnn" and "cnn_2of4" in figures:
            nm = figures["cnn_2of4"]
            rows.append({"model": "cnn", "method": "2:4 from mid-run", "ours acc": nm["test_acc"],
                         "dense acc": dense, "ours - dense (pts)": 100 * (nm["test_acc"] - dense),
                         "ours sparsity": nm["sparsity"]})  # fmt: skip
    structured_rows = []
    for model_name in ("cnn", "mlp"):
        summary = figures.get(f"{model_name}_structured_summary")
        if summary is None:
            continue
        latency, flops = summary["latency_s"], summary["flops"]
        params = {
            "ours": figures[f"{model_name}_structured_0.5"]["params"],
            "dense": figures[f"{model_name}_dense"]["params"],
        }
        dense_acc = figures[f"{model_name}_dense"]["test_acc"]
        row = {
            "model": model_name,
            "latency ours/dense": ratio(latency["ours"], latency["dense"]),
            "FLOPs ours/dense": ratio(flops["ours"], flops["dense"]),
            "params ours/dense": ratio(params["ours"], params["dense"]),
            "speedup / FLOPs ratio": (latency["dense"] / latency["ours"]) / (flops["dense"] / flops["ours"]),
            "acc ours - dense (pts)": 100 * (figures[f"{model_name}_structured_0.5"]["test_acc"] - dense_acc),
            "dense ms/batch": 1000 * latency["dense"],
        }
        if "ModelPruning" in latency:
            row["latency ModelPruning/dense"] = ratio(latency["ModelPruning"], latency["dense"])
            peer_acc = figures[f"{model_name}_modelpruning_structured_0.5"]["test_acc"]
            row["acc ModelPruning - dense (pts)"] = 100 * (peer_acc - dense_acc)
        structured_rows.append(row)

    sweep_rows = []
    if "cnn_dense" in figures:
        dense_acc = figures["cnn_dense"]["test_acc"]
        for name, what in (("cnn_structured_0.5", "StructuredPruning(0.5), l2, ramp to 3/4 (the table above)"),
                           ("cnn_structured_0.5_taylor", "importance='taylor'"),
                           ("cnn_structured_0.5_end0.5", "ramp to 1/2 (longer recovery)"),
                           ("cnn_half_width_scratch", "half the channels, from scratch (capacity)")):  # fmt: skip
            if name in figures:
                sweep_rows.append({"run": what, "test acc": figures[name]["test_acc"],
                                   "vs dense (pts)": 100 * (figures[name]["test_acc"] - dense_acc),
                                   "params": figures[name]["params"]})  # fmt: skip
    print("\nUnstructured and 2:4 pruning vs dense and Lightning's ModelPruning (test accuracy, one seed)")
    table = print_table(rows, ["model", "method", "ours acc", "ModelPruning acc", "dense acc", "ours - dense (pts)",
                               "peer - dense (pts)", "ours sparsity", "peer sparsity"])  # fmt: skip
    print("\nStructuredPruning(0.5) then fine-tuning: CPU inference (batch 256) as ratios to dense")
    table2 = print_table(structured_rows, ["model", "latency ours/dense", "latency ModelPruning/dense",
                                           "FLOPs ours/dense", "params ours/dense", "speedup / FLOPs ratio",
                                           "acc ours - dense (pts)", "acc ModelPruning - dense (pts)",
                                           "dense ms/batch"])  # fmt: skip
    table3 = ""
    if sweep_rows:
        print("\nStructured CNN accuracy: settings tried, and the same-size model trained from scratch")
        table3 = print_table(sweep_rows, ["run", "test acc", "vs dense (pts)", "params"])
    parts = [
        f"{r['model']} 90%: {r['ours - dense (pts)']:+.2f} pts vs dense (ModelPruning {r['peer - dense (pts)']:+.2f})"
        for r in rows
        if r["method"] == "unstructured 90%"
    ]
    parts += [f"structured {r['model']} latency {r['latency ours/dense']:.2f}x" for r in structured_rows]
    tables = {"table": table, "structured_table": table2, "structured_sweep_table": table3}
    write_results("pruning", {"runs": runs, "figures": figures, **tables}, "; ".join(parts),
                  args.results_dir, command=command)  # fmt: skip
    return figures


MODEL_NAMES = {"cnn": "CNN", "resnet18": "ResNet-18", "mlp": "MLP"}
SWEEP_RUNS = (("cnn_structured_0.5", "`StructuredPruning(0.5)` (L2 importance, default ramp)"),
              ("cnn_structured_0.5_taylor", "`importance=\"taylor\"`"),
              ("cnn_structured_0.5_end0.5", "`schedule=PruningSchedule(end=0.5)` (longer recovery)"),
              ("cnn_half_width_scratch", "half the channels, trained from scratch (capacity)"))  # fmt: skip


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``pruning`` figure block (docs/pruning.md), from ``results/pruning.json`` only: each part's run (or
    that the file does not record them), the unstructured table (test accuracy against dense of
    MagnitudePruning and ModelPruning at each sparsity, the sparsity reached, the 2:4 run), the structured
    figures (inference latency, FLOPs and parameters as ratios to dense, speed-up over the FLOPs ratio,
    accuracy; ModelPruning's structured masks) and the structured CNN settings tried."""
    from benchmarks.common import count, load_results, points, runs_line, sig, times

    results = load_results(results_dir, "pruning.json")
    f = results["figures"]
    cfg = f.get("config", {})
    batches = cfg.get("batches_per_epoch", {})
    lines = [
        runs_line(results, "pruning.json", PARTS, results_dir),
        "",
        f"Fashion-MNIST, {cfg.get('epochs', '?')} epochs of {batches.get('cnn', '?')} batches of "
        f"{cfg.get('batch_size', '?')} (ResNet-18: {batches.get('resnet18', '?')} batches per epoch), one process, "
        f"{cfg.get('threads', '?')} threads, seed {cfg.get('seed', '?')}, one run per row; test accuracy.",
        "",
        "| model (parameters, dense test acc) | sparsity | MagnitudePruning vs dense | ModelPruning vs dense "
        "| sparsity reached (ours / ModelPruning) |",
        "|---|---|---|---|---|",
    ]
    for model in ("cnn", "resnet18"):
        dense = f.get(f"{model}_dense")
        if dense is None:
            continue
        name = f"{MODEL_NAMES[model]} ({count(dense['params'])}, {sig(dense['test_acc'])})"
        for s in sorted(k.removeprefix(f"{model}_magnitude_") for k in f if k.startswith(f"{model}_magnitude_")):
            ours, peer = f[f"{model}_magnitude_{s}"], f.get(f"{model}_modelpruning_{s}")
            if peer is None:
                continue
            lines.append(
                f"| {name} | {float(s):.0%} | {points(100 * (ours['test_acc'] - dense['test_acc']))} "
                f"| {points(100 * (peer['test_acc'] - dense['test_acc']))} "
                f"| {sig(ours['sparsity'])} / {sig(peer['sparsity'])} |"
            )
        if model == "cnn" and "cnn_2of4" in f:
            nm = f["cnn_2of4"]
            lines.append(
                f"| {name} | 2:4 from mid-run | {points(100 * (nm['test_acc'] - dense['test_acc']))} | - "
                f"| {sig(nm['sparsity'])} / - |"
            )
    structured = [m for m in ("cnn", "mlp") if f"{m}_structured_summary" in f]
    if structured:
        lines += [
            "",
            "`StructuredPruning(0.5)` then fine-tuning; CPU inference latency (medians of alternating rounds), FLOPs "
            "and parameters as ratios to dense:",
            "",
            "| model (dense parameters) | latency | FLOPs | parameters | speed-up / FLOPs reduction "
            "| accuracy vs dense | ModelPruning structured masks: latency, accuracy |",
            "|---|---|---|---|---|---|---|",
        ]
        for model in structured:
            latency, flops = f[f"{model}_structured_summary"]["latency_s"], f[f"{model}_structured_summary"]["flops"]
            dense, ours = f[f"{model}_dense"], f[f"{model}_structured_0.5"]
            peer = "-"
            if "ModelPruning" in latency:
                peer_acc = f[f"{model}_modelpruning_structured_0.5"]["test_acc"]
                peer = (f"{times(latency['ModelPruning'] / latency['dense'])}, "
                        f"{points(100 * (peer_acc - dense['test_acc']))}")  # fmt: skip
            lines.append(
                f"| {MODEL_NAMES.get(model, model)} ({count(dense['params'])}) "
                f"| **{times(latency['ours'] / latency['dense'])}** | {times(flops['ours'] / flops['dense'])} "
                f"| {times(ours['params'] / dense['params'])} "
                f"| {sig((latency['dense'] / latency['ours']) / (flops['dense'] / flops['ours']))} "
                f"| {points(100 * (ours['test_acc'] - dense['test_acc']))} | {peer} |"
            )
    sweep = [(key, what) for key, what in SWEEP_RUNS if key in f]
    if len(sweep) > 1 and "cnn_dense" in f:
        dense = f["cnn_dense"]
        lines += ["", "Structured CNN, settings tried:", "",
                  "| run | parameters | accuracy vs dense |", "|---|---|---|"]  # fmt: skip
        for key, what in sweep:
            lines.append(
                f"| {what} | {count(f[key]['params'])} | {points(100 * (f[key]['test_acc'] - dense['test_acc']))} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
