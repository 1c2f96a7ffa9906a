"""Operator fusion: training-step time eager vs plain torch.compile vs OperatorFusion; the fused optimizer step;
the chunked LM-head loss.

    python -m benchmarks.fusion [--quick] [--parts step optimizer loss] [--results-dir DIR]

* step: a char-GPT (4 layers, width 256, block 128, batch 16), the Fashion-MNIST CNN and a memory-bound
  network (12 blocks of LayerNorm + GELU + SiLU gating + residual on 784 pixels, batch 1024), one CPU
  process with 2 threads, 45 steps. Peers in the same run: eager Lightning (no callback) and plain
  ``model.compile()`` before ``fit`` (what a user would do). Ours: ``OperatorFusion()`` (compile="auto", the
  fused optimizer). Reported: median step time over the last 15 steps as a ratio to eager (> 1 is faster),
  and start-up (time to the end of the 3rd step, each variant with empty compile caches) of regional vs
  full compile.
* optimizer: AdamW step over the GPT's parameters: fused kernel vs torch's CPU default (for-loop).
* swaps: module surgery alone (``OperatorFusion("off", fused_optimizer=False, swap_modules=[...])``): the char-GPT
  with its attention written by hand (``CharGPT(attention="written")``) eager vs swapped to SDPA, and with the
  default ``OperatorFusion()``; the memory-bound network with norm+activation pairs recomputed (step time and
  bytes saved for backward); the CNN's evaluation with Conv+BN folded.
* loss: vocabulary 32,000, 8,192 tokens, hidden 256: peak memory (process RSS growth, fresh process each) and
  time of forward+backward, chunked linear+cross-entropy vs ``F.cross_entropy(hidden @ W.T)``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, command_line, print_table, ratio, run_worker, summarize, write_results

PARTS = ("step", "optimizer", "loss", "swaps")


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _pointwise_net() -> Any:
    """A memory-bound network: chains of LayerNorm, GELU, SiLU gating and residual adds on Fashion-MNIST
    pixels (784 features), 12 blocks, a linear classifier: almost no matmul, so eager pays one pass over memory
    per operation and fusion saves most of them."""
    import lightning as L
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Chain(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.scale = nn.Parameter(torch.full((d,), 0.1))

        def forward(self, x):
            y = F.gelu(self.norm(x))
            y = y * torch.sigmoid(y * 1.702)
            return x + self.scale * y

    class PointwiseNet(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*(Chain(784) for _ in range(12)))
            self.head = nn.Linear(784, 10)

        def forward(self, x):
            return self.head(self.blocks(x.flatten(1)))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return PointwiseNet()


def step_worker(model_name: str, variant: str, steps: int, out: str) -> None:
    import lightning as L
    import torch

    from lightning_bigtrain.callbacks import OperatorFusion
    from lightning_bigtrain.data import FashionMNISTDataModule, ShakespeareDataModule
    from lightning_bigtrain.models import CharGPT, FashionCNN

    torch.set_num_threads(2)
    L.seed_everything(0, verbose=False)
    if model_name in ("gpt", "gpt_written"):
        attention = "written" if model_name == "gpt_written" else "sdpa"
        model: Any = CharGPT(block_size=128, n_layer=4, n_head=4, n_embd=256, attention=attention)
        data: Any = ShakespeareDataModule(block_size=128, batch_size=16)
    elif model_name == "pointwise":
        model = _pointwise_net()
        data = FashionMNISTDataModule(batch_size=1024)
    else:
        model = FashionCNN()
        data = FashionMNISTDataModule(batch_size=128)
    times: list[float] = []

    class Timer(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.start = time.perf_counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            times.append(time.perf_counter() - self.t0)
            if batch_idx == 2:
                self.startup = time.perf_counter() - self.start

    timer = Timer()
    callbacks: list[Any] = [timer]
    if variant.startswith("fusion"):
        mode = variant.partition("_")[2] or "auto"
        callbacks.insert(0, OperatorFusion(mode))  # type: ignore[arg-type]
    if variant == "compile":
        model.compile()
    if variant.startswith("swap"):  # the swaps alone: no compile, no fused optimizer
        kinds = ["norm_activation"] if variant == "swap_norm" else ["attention"]
        callbacks.insert(0, OperatorFusion("off", fused_optimizer=False, swap_modules=kinds))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)  # fmt: skip
    trainer.fit(model, datamodule=data)
    fusion = callbacks[0] if variant.startswith("fusion") else None
    Path(out).write_text(json.dumps({
        "median_step_s": summarize(times[-15:])["median"],
        "startup_s": timer.startup,
        "peak_rss_bytes": _rss(),
        "choice": getattr(fusion, "choice", None),
        "timings": getattr(fusion, "timings", None),
    }))  # fmt: skip


def optimizer_worker(out: str) -> None:
    import torch

    from lightning_bigtrain.functional.fusion import fuse_optimizer
    from lightning_bigtrain.models import CharGPT

    torch.set_num_threads(2)
    model = CharGPT(block_size=128, n_layer=4, n_head=4, n_embd=256)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    result = {}
    for name, make in (("for-loop", lambda: torch.optim.AdamW(model.parameters(), lr=1e-3)),
                       ("fused", lambda: fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3)))):  # fmt: skip
        opt = make()
        opt.step()
        samples = []
        for _ in range(30):
            t0 = time.perf_counter()
            opt.step()
            samples.append(time.perf_counter() - t0)
        result[name] = summarize(samples)["median"]
    Path(out).write_text(json.dumps(result))


def swaps_worker(out: str) -> None:
    """Saved-for-backward bytes of one pointwise-net forward (batch 1024) with and without the norm+activation
    swap, and evaluation of the Fashion-MNIST CNN (batch 256) with Conv+BN folded vs as trained."""
    import torch

    from lightning_bigtrain.data import FashionMNISTDataModule
    from lightning_bigtrain.functional.surgery import fold_conv_bn, swap_modules
    from lightning_bigtrain.models import FashionCNN

    torch.set_num_threads(2)
    torch.manual_seed(0)
    data = FashionMNISTDataModule(batch_size=256)
    data.setup("fit")
    batches = [x for x, _ in list(data.train_dataloader())[:12]]

    def saved_bytes(model: Any, x: Any) -> int:
        storages: dict[int, int] = {}

        def pack(t: Any) -> Any:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
        return sum(storages.values())

    net = _pointwise_net()
    x = torch.cat(batches[:4])
    plain_saved = saved_bytes(net, x)
    swap_modules(net, ["norm_activation"])
    result: dict[str, Any] = {"norm_saved_plain": plain_saved, "norm_saved_swapped": saved_bytes(net, x)}

    cnn = FashionCNN()
    with torch.no_grad():
        for b in batches[:8]:  # BatchNorm running statistics from real batches
            cnn(b)
    cnn.eval()
    folded = fold_conv_bn(cnn)
    with torch.no_grad():
        result["fold_max_abs_diff"] = max(float((folded(b) - cnn(b)).abs().max()) for b in batches[8:])
        for name, model in (("fold_plain_s", cnn), ("fold_folded_s", folded)):
            samples = []
            for _ in range(3):
                t0 = time.perf_counter()
                for b in batches:
                    model(b)
                samples.append((time.perf_counter() - t0) / len(batches))
            result[name] = summarize(samples)["median"]
    Path(out).write_text(json.dumps(result))


def loss_worker(variant: str, tokens: int, vocab: int, out: str) -> None:
    import torch
    import torch.nn.functional as F

    from lightning_bigtrain.functional.fused_loss import chunked_linear_cross_entropy

    torch.set_num_threads(2)
    torch.manual_seed(0)
    hidden = torch.randn(tokens, 256, requires_grad=True)
    weight = (torch.randn(vocab, 256) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))

    def run() -> None:
        if variant == "plain":
            loss = F.cross_entropy(hidden @ weight.t(), targets)
        else:
            loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=1024)
        loss.backward()
        hidden.grad = weight.grad = None

    base = _rss()
    run()  # the first call sets the process's peak
    peak = _rss() - base
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
    Path(out).write_text(json.dumps({"peak_bytes": peak, "seconds": summarize(samples)["median"]}))


def _cold_cache_worker(args: list[str]) -> dict[str, Any]:
    """A worker with its own, empty Inductor/AOTAutograd caches: otherwise the first compiling variant fills the
    on-disk cache and every later one starts up from it, which would make start-up times meaningless."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        saved = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        os.environ["TRITON_CACHE_DIR"] = cache
        try:
            return run_worker("benchmarks.fusion", args)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--models", nargs="+", choices=("gpt", "cnn", "pointwise"), default=["gpt", "cnn", "pointwise"])
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        kind, *rest = args.worker
        if kind == "step":
            step_worker(rest[0], rest[1], int(rest[2]), args.out)
        elif kind == "optimizer":
            optimizer_worker(args.out)
        elif kind == "swaps":
            swaps_worker(args.out)
        else:
            loss_worker(rest[0], int(rest[1]), int(rest[2]), args.out)
        return {}

    figures: dict[str, Any] = {}
    tables: dict[str, str] = {}
    headline = []
    if "step" in args.parts:
        steps = 12 if args.quick else 45
        rows = []
        for model_name in args.models:
            runs = {v: _cold_cache_worker(["--worker", "step", model_name, v, str(steps)])
                    for v in ("eager", "compile", "fusion", "fusion_regional", "fusion_full")}  # fmt: skip
            eager = runs["eager"]["median_step_s"]
            figures[model_name] = runs
            rows.append({
                "model": model_name,
                "eager ms": eager * 1e3,
                "compile speed-up": ratio(eager, runs["compile"]["median_step_s"]),
                "OperatorFusion speed-up": ratio(eager, runs["fusion"]["median_step_s"]),
                "auto chose": runs["fusion"]["choice"],
                "regional start-up / full": ratio(
                    runs["fusion_regional"]["startup_s"], runs["fusion_full"]["startup_s"]
                ),
                "regional speed-up": ratio(eager, runs["fusion_regional"]["median_step_s"]),
                "full speed-up": ratio(eager, runs["fusion_full"]["median_step_s"]),
            })  # fmt: skip
            headline.append(
                f"{model_name} step x{rows[-1]['OperatorFusion speed-up']:.2f} "
                f"(compile x{rows[-1]['compile speed-up']:.2f})"
            )
        print("\nTraining step, 1 CPU process x 2 threads; speed-ups are eager / variant (median step, last 15 steps)")
        tables["step"] = print_table(rows, list(rows[0]))
    if "optimizer" in args.parts:
        r = run_worker("benchmarks.fusion", ["--worker", "optimizer"])
        figures["optimizer"] = r
        rows = [{"optimizer": "AdamW, 3.2M params", "for-loop ms": r["for-loop"] * 1e3, "fused ms": r["fused"] * 1e3,
                 "speed-up": ratio(r["for-loop"], r["fused"])}]  # fmt: skip
        print("\nOptimizer step: fused kernel vs torch's CPU default")
        tables["optimizer"] = print_table(rows, list(rows[0]))
        headline.append(f"fused AdamW x{rows[0]['speed-up']:.2f}")
    if "loss" in args.parts:
        tokens, vocab = (2048, 8000) if args.quick else (8192, 32000)
        runs = {
            v: run_worker("benchmarks.fusion", ["--worker", "loss", v, str(tokens), str(vocab)])
            for v in ("plain", "chunked")
        }
        figures["loss"] = runs
        rows = [{"tokens": tokens, "vocab": vocab,
                 "plain peak MiB": runs["plain"]["peak_bytes"] / 2**20,
                 "chunked peak MiB": runs["chunked"]["peak_bytes"] / 2**20,
                 "peak chunked / plain": ratio(runs["chunked"]["peak_bytes"], runs["plain"]["peak_bytes"]),
                 "time chunked / plain": ratio(runs["chunked"]["seconds"], runs["plain"]["seconds"])}]  # fmt: skip
        print("\nLM-head loss, forward + backward (peak: process RSS growth)")
        tables["loss"] = print_table(rows, list(rows[0]))
        headline.append(
            f"chunked CE peak x{rows[0]['peak chunked / plain']:.2f} at time x{rows[0]['time chunked / plain']:.2f}"
        )
    if "swaps" in args.parts:
        steps = 12 if args.quick else 45
        written = {v: _cold_cache_worker(["--worker", "step", "gpt_written", v, str(steps)])
                   for v in ("eager", "swap", "fusion")}  # fmt: skip
        pointwise = {v: run_worker("benchmarks.fusion", ["--worker", "step", "pointwise", v, str(steps)])
                     for v in ("eager", "swap_norm")}  # fmt: skip
        other = run_worker("benchmarks.fusion", ["--worker", "swaps"])
        figures["swaps"] = {"gpt_written": written, "pointwise": pointwise, "other": other}
        eager = written["eager"]["median_step_s"]
        rows = [
            {"swap": "attention (char-GPT, written -> SDPA)", "measure": "training step",
             "speed-up": ratio(eager, written["swap"]["median_step_s"]),
             "memory ratio": ratio(written["swap"]["peak_rss_bytes"], written["eager"]["peak_rss_bytes"]),
             "memory measure": "process peak RSS"},
            {"swap": "OperatorFusion() on the written char-GPT", "measure": "training step",
             "speed-up": ratio(eager, written["fusion"]["median_step_s"]),
             "memory ratio": ratio(written["fusion"]["peak_rss_bytes"], written["eager"]["peak_rss_bytes"]),
             "memory measure": f"process peak RSS (auto chose {written['fusion']['choice']})"},
            {"swap": "norm+activation recomputed (pointwise net)", "measure": "training step",
             "speed-up": ratio(pointwise["eager"]["median_step_s"], pointwise["swap_norm"]["median_step_s"]),
             "memory ratio": ratio(other["norm_saved_swapped"], other["norm_saved_plain"]),
             "memory measure": "bytes saved for backward"},
            {"swap": "Conv+BN folded (CNN, eval)",
             "measure": f"inference (max abs diff {other['fold_max_abs_diff']:.1e})",
             "speed-up": ratio(other["fold_plain_s"], other["fold_folded_s"]), "memory ratio": "",
             "memory measure": ""},
        ]  # fmt: skip
        print("\nModule swaps, 1 CPU process x 2 threads; speed-up = before / after, memory = after / before")
        tables["swaps"] = print_table(rows, list(rows[0]))
        headline.append(f"attention swap x{rows[0]['speed-up']:.2f}, norm+act saved x{rows[2]['memory ratio']:.2f}")
    config = {"quick": args.quick, "parts": args.parts, "steps": 12 if args.quick else 45, "timed_steps": 15}
    if "loss" in args.parts:
        config["loss_tokens"], config["loss_vocab"] = tokens, vocab
    payload = {"config": config, "figures": figures, "tables": tables}
    command = command_line("benchmarks.fusion", argv)
    print(f"wrote {write_results('fusion', payload, '; '.join(headline), args.results_dir, command=command)}")
    return figures


def render_block(results_dir: Path = RESULTS_DIR) -> str:
    """The ``fusion`` figure block (docs/fusion.md), from ``results/fusion.json`` only: per model the training
    step's speed-up over eager of OperatorFusion (and what ``compile="auto"`` chose), plain ``model.compile()``,
    regional and full compile, and regional start-up over full; the fused optimizer step; the chunked LM-head
    loss's peak memory and time; the module swaps."""
    from benchmarks.common import load_results, measured_line, sig, times

    results = load_results(results_dir, "fusion.json")
    f, cfg = results["figures"], results.get("config", {})
    lines = [measured_line(results, "fusion.json", results_dir), ""]
    models = [m for m in ("gpt", "cnn", "pointwise") if m in f]
    if models:
        timed = f"median of the last {cfg['timed_steps']} of {cfg['steps']} steps" if "steps" in cfg else "median step"
        lines += [
            f"Training step, one CPU process, each variant with empty compile caches; speed-up = eager / variant "
            f"({timed}; > 1: faster).",
            "",
            "| model | eager step, ms | `OperatorFusion()` (auto chose) | plain `model.compile()` | regional | full "
            "| regional start-up / full |",
            "|---|---|---|---|---|---|---|",
        ]
        names = {"gpt": "char-GPT", "cnn": "CNN", "pointwise": "LayerNorm+GELU chain network"}
        for m in models:
            r = f[m]
            eager = r["eager"]["median_step_s"]
            lines.append(
                f"| {names[m]} | {sig(1e3 * eager)} | **{times(eager / r['fusion']['median_step_s'])}** "
                f"({r['fusion']['choice']}) | {times(eager / r['compile']['median_step_s'])} "
                f"| {times(eager / r['fusion_regional']['median_step_s'])} "
                f"| {times(eager / r['fusion_full']['median_step_s'])} "
                f"| {times(r['fusion_regional']['startup_s'] / r['fusion_full']['startup_s'])} |"
            )
        lines.append("")
    if "optimizer" in f:
        o = f["optimizer"]
        lines.append(
            f"Fused AdamW step: **{times(o['for-loop'] / o['fused'])}** faster than torch's CPU default (for-loop): "
            f"{sig(1e3 * o['fused'])} ms vs {sig(1e3 * o['for-loop'])} ms."
        )
    if "loss" in f:
        plain, chunked = f["loss"]["plain"], f["loss"]["chunked"]
        size = (f" (vocabulary {cfg['loss_vocab']:,}, {cfg['loss_tokens']:,} tokens)" if "loss_vocab" in cfg
                else "")  # fmt: skip
        peak = times(chunked["peak_bytes"] / plain["peak_bytes"])
        lines += [
            "",
            f"Chunked LM-head cross-entropy{size}, forward + backward: **{peak}** the peak memory at "
            f"{times(chunked['seconds'] / plain['seconds'])} the time of `F.cross_entropy(hidden @ W.T)`.",
        ]
    if "swaps" in f:
        s = f["swaps"]
        w, pw, other = s["gpt_written"], s["pointwise"], s["other"]
        lines += [
            "",
            "| module swap | speed-up | memory after / before |",
            "|---|---|---|",
            f"| attention written by hand -> SDPA (char-GPT, training step) "
            f"| {times(w['eager']['median_step_s'] / w['swap']['median_step_s'])} "
            f"| {times(w['swap']['peak_rss_bytes'] / w['eager']['peak_rss_bytes'])} (process peak RSS) |",
            f"| `OperatorFusion()` on that char-GPT (auto chose {w['fusion']['choice']}) "
            f"| {times(w['eager']['median_step_s'] / w['fusion']['median_step_s'])} "
            f"| {times(w['fusion']['peak_rss_bytes'] / w['eager']['peak_rss_bytes'])} (process peak RSS) |",
            f"| norm+activation recomputed (chain network, training step) "
            f"| {times(pw['eager']['median_step_s'] / pw['swap_norm']['median_step_s'])} "
            f"| {times(other['norm_saved_swapped'] / other['norm_saved_plain'])} (bytes saved for backward) |",
            f"| Conv+BN folded (CNN, evaluation; max abs diff {other['fold_max_abs_diff']:.1e}) "
            f"| {times(other['fold_plain_s'] / other['fold_folded_s'])} | - |",
        ]
    return "\n".join(lines).rstrip()


if __name__ == "__main__":
    main(sys.argv[1:])
