"""Structured pruning vs Torch-Pruning: parameters removed at the same amount, on the same models.

    python -m benchmarks.structured_peer [--amount 0.5] [--families F ...] [--render]

For each model (built from its config as in :mod:`benchmarks.conformance`: Hugging Face GPT-2/Llama/BERT/T5,
Lightning's demo Transformer, an ``nn.TransformerEncoder`` LM, torchvision's ViT and ResNet-18, timm's ViT and
ConvNeXt) two copies with the same weights are pruned once, in one process:

* **ours**: the channel groups ``StructuredPruning`` finds (``nn.MultiheadAttention`` swapped for
  ``HeadedAttention`` as the callback does at setup), each group cut to ``1 - amount`` of its channels by L2
  importance, the channels removed: what one ``StructuredPruning(amount)`` event does;
* **Torch-Pruning** (``torch_pruning.MetaPruner``, L2 magnitude importance, ``pruning_ratio=amount``, the output
  layer ignored, every ``nn.MultiheadAttention`` and Hugging Face attention's head count given): run with its
  defaults, with ``prune_num_heads=True`` and, for Hugging Face models, with their eager (written-out) attention
  instead of SDPA; the best of these is reported (and which one).

Both pruned models are then called on the example input: a model that no longer runs counts as broken. Reported:
the fraction of parameters removed by each, and their ratio. Nothing is trained; it is the structure each tool can
find and cut. ``results/structured_peer.json``; the README's table is rendered from it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

FAMILIES = ("hf_gpt2", "lightning_demo_transformer", "nn_transformer", "hf_llama", "hf_bert", "hf_t5", "tv_vit",
            "timm_vit", "tv_resnet18", "timm_convnext")  # fmt: skip


def _model_and_call(family: str) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], Any]:
    """The model the family's LightningModule trains (its ``.model``), an example call and its output layer."""
    from benchmarks.conformance import FAMILIES as ALL
    from benchmarks.conformance import _build

    model = _build(ALL[family], 0).model.eval()
    if ALL[family].data == "images":
        channels = 1 if family.startswith("timm") else 3
        x = torch.randn(2, channels, 32, 32)
        head = getattr(model, "fc", None) or getattr(model, "heads", None) or getattr(model, "head", None)
        return model, (x,), {}, head
    ids = torch.randint(0, 96, (2, 32))
    if family == "lightning_demo_transformer":
        return model, (ids, ids), {}, model.decoder
    if family == "nn_transformer":
        return model, (ids,), {}, model.head
    kwargs = {"input_ids": ids, **({"decoder_input_ids": ids} if family == "hf_t5" else {})}
    return model, (), kwargs, model.get_output_embeddings()


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _runs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        with torch.no_grad():
            model(*args, **kwargs)
        return True
    except Exception:
        return False


def ours(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], amount: float) -> dict[str, Any]:
    from lightning_bigtrain.functional.attention import swap_multihead_attention_
    from lightning_bigtrain.functional.structured import (
        channel_groups,
        channel_importance,
        keep_indices,
        remove_channels_,
    )

    before = _count(model)
    swap_multihead_attention_(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        groups = channel_groups(model, args, example_kwargs=kwargs)
    kept = {g.id: keep_indices(channel_importance(model, g), amount) for g in groups if g.prunable}
    remove_channels_(model, groups, kept)
    return {"removed": 1 - _count(model) / before, "runs": _runs(model, args, kwargs),
            "groups": sum(g.prunable for g in groups)}  # fmt: skip


def torch_pruning(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], head: nn.Module | None,
                  amount: float) -> dict[str, Any]:  # fmt: skip
    """Torch-Pruning's best of its default and head-removing configurations on a copy of ``model``."""
    import torch_pruning as tp

    results = []
    configs = ["default", "prune_num_heads"] + (["eager attention"] if kwargs else [])
    for config in configs:
        m = copy.deepcopy(model)
        if config == "eager attention":  # Hugging Face's written-out attention instead of SDPA: easier to trace
            m.config._attn_implementation = "eager"
        before = _count(m)
        heads: dict[nn.Module, int] = {}
        for module in m.modules():
            if isinstance(module, nn.MultiheadAttention):
                heads[module] = module.num_heads
            for attr in ("q_proj", "k_proj", "v_proj", "c_attn", "query", "key", "value", "q", "k", "v", "qkv"):
                layer = getattr(module, attr, None)
                n = getattr(module, "num_heads", None) or getattr(getattr(module, "config", None), "num_heads", None)
                if isinstance(layer, nn.Module) and isinstance(n, int):
                    heads[layer] = n
        ignored = [mm for mm in m.modules() if head is not None and mm is _same(m, model, head)]
        example = kwargs if kwargs else (args if len(args) > 1 else args[0])
        try:
            with warnings.catch_warnings(), _time_limit(TP_SECONDS):
                warnings.simplefilter("ignore")
                pruner = tp.pruner.MetaPruner(
                    m, example, importance=tp.importance.MagnitudeImportance(p=2), pruning_ratio=amount,
                    ignored_layers=ignored, num_heads=heads, prune_num_heads=config == "prune_num_heads",
                    output_transform=(lambda out: out.logits.sum()) if kwargs else None,
                )  # fmt: skip
                pruner.step()
            result = {"removed": 1 - _count(m) / before, "runs": _runs(m, args, kwargs), "config": config, "error": ""}
        except Exception as err:
            result = {"removed": 0.0, "runs": False, "config": config,
                      "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}  # fmt: skip
        results.append(result)
    running = [r for r in results if r["runs"]]
    best = max(running, key=lambda r: r["removed"]) if running else results[0]
    return best


TP_SECONDS = 120  # Torch-Pruning's dependency search can run for tens of minutes on a tiny HF model


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def stop(signum: int, frame: Any) -> None:
        raise TimeoutError(f"did not finish in {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _same(copy_root: nn.Module, root: nn.Module, module: nn.Module) -> nn.Module | None:
    """The module of ``copy_root`` at the path ``module`` has in ``root``."""
    for (_, a), (_, b) in zip(root.named_modules(), copy_root.named_modules(), strict=True):
        if a is module:
            return b
    return None


def measure(families: list[str], amount: float) -> list[dict[str, Any]]:
    rows = []
    for family in families:
        model, args, kwargs, head = _model_and_call(family)
        params = _count(model)
        peer = torch_pruning(model, args, kwargs, head, amount)
        try:
            own = ours(copy.deepcopy(model), args, kwargs, amount)
        except Exception as err:
            traceback.print_exc()
            own = {"removed": 0.0, "runs": False, "groups": 0, "error": f"{type(err).__name__}: {err}"[:200]}
        row = {
            "model": family,
            "params": params,
            "ours removed": round(own["removed"], 3),
            "ours runs": own["runs"],
            "Torch-Pruning removed": round(peer["removed"], 3),
            "Torch-Pruning runs": peer["runs"],
            "Torch-Pruning config": peer["config"],
            "Torch-Pruning error": peer["error"],
        }
        print(row, flush=True)
        rows.append(row)
    return rows


README = Path(__file__).resolve().parents[1] / "README.md"
_BEGIN, _END = "<!-- structured-peer:begin -->", "<!-- structured-peer:end -->"


def render(results: dict[str, Any]) -> str:
    """The ``structured-peer`` figure block (docs/pruning.md), markers included, from
    ``results/structured_peer.json``."""
    measured = f"Measured {results['machine']['time'][:10]} at commit `{results['commit']}`"
    lines = [
        _BEGIN,
        f"{measured} (`{results['command']}`; `benchmarks/results/structured_peer.json`), amount "
        f"{results['amount']}: fraction of parameters removed (a pruned model that no longer runs is marked broken).",
        "",
        "| model | parameters | StructuredPruning | Torch-Pruning (best config) |",
        "|---|---|---|---|",
    ]
    for r in results["rows"]:
        own = f"{r['ours removed']:.1%}" + ("" if r["ours runs"] else " (broken)")
        if r["Torch-Pruning error"] and not r["Torch-Pruning runs"]:
            peer = f"fails: {r['Torch-Pruning error'][:90]}"
        else:
            peer = f"{r['Torch-Pruning removed']:.1%} ({r['Torch-Pruning config']})"
            peer += "" if r["Torch-Pruning runs"] else " (broken)"
        lines.append(f"| {r['model']} | {r['params'] / 1e3:.0f}k | {own} | {peer} |")
    lines.append(_END)
    return "\n".join(lines)


def render_readme(path: Path, readme: Path = README) -> None:
    """Re-render the ``structured-peer`` block from ``path`` wherever it stands in README.md and docs/*.md
    (:func:`benchmarks.figures.write`; ``readme`` is kept for callers, the docs are found by the registry)."""
    from benchmarks.figures import write

    for problem in write(keys=["structured-peer"], results_dir=path.parent):
        print(f"warning: {problem}")


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import RESULTS_DIR, git_commit, print_table, write_results

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--amount", type=float, default=0.5)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render", action="store_true", help="only re-render the README block")
    args = parser.parse_args(argv)
    if args.render:
        render_readme(args.results_dir / "structured_peer.json")
        return 0
    commit = git_commit()  # the code that runs
    torch.manual_seed(0)
    rows = measure(args.families, args.amount)
    print_table(rows, ["model", "params", "ours removed", "Torch-Pruning removed", "Torch-Pruning config"])
    command = " ".join(["python -m benchmarks.structured_peer", *(argv if argv is not None else sys.argv[1:])])
    ahead = sum(r["ours removed"] >= r["Torch-Pruning removed"] and r["ours runs"] for r in rows)
    write_results("structured_peer", {"commit": commit, "command": command, "amount": args.amount, "rows": rows},
                  f"ours >= Torch-Pruning on {ahead}/{len(rows)} models", args.results_dir)  # fmt: skip
    return 0  # write_results re-rendered the docs' block


if __name__ == "__main__":
    sys.exit(main())
