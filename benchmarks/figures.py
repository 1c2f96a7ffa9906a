"""Every measured figure in README.md and docs/*.md is rendered from ``benchmarks/results/*.json``.

    python -m benchmarks.figures            # rewrite every figure block in README.md and docs/*.md
    python -m benchmarks.figures --check    # exit 1 on a block that differs from its rendering, a block missing
                                            # from its doc, or a measured-looking figure typed outside the blocks

A figure block is the text of a doc between ``<!-- KEY:begin -->`` and ``<!-- KEY:end -->``; :data:`BLOCKS` maps
each key to the function that renders it from a results folder, the docs it belongs in and the results files it
reads. Each rendering starts with a line saying when, at which commit and with which command the figures were
measured, and from which file (what a file does not record is said to be not recorded), and contains only values
in the results files or ratios of them. Benchmarks re-render their blocks when they write their results
(:func:`benchmarks.common.write_results`); ``make bench`` runs this script at the end.

``--check`` also scans README.md and docs/*.md outside the blocks and fenced code, and the docstrings and
comments of ``lightning_bigtrain``, for figures that look measured (:data:`FIGURE_PATTERNS`: ``1.23x``, ``x1.23``,
``13.9%``, ``+0.65 pts``); a constant that is not a measurement is let through by ``not-a-figure`` on its line
(``<!-- not-a-figure -->`` in Markdown, ``# not-a-figure`` in Python). Put measured figures in a block instead.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import io
import re
import sys
import tokenize
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, ROOT, load_results, percent, points, times

__all__ = ["BLOCKS", "FIGURE_PATTERNS", "Block", "Problem", "check", "find_blocks", "render", "write"]

Renderer = Callable[[Path], str]

_TIMES, _MINUS = "\u00d7", "\u2212"  # the multiplication and minus signs, as typed in prose
#: Measured-looking figures: a decimal ratio (``1.23x``, ``0.5x`` also with the multiplication sign, ``x1.23``), a
#: decimal percentage (``13.9%``, ``+0.08 %``) and a signed difference in points (``+0.65 pts``, ``-2 points``,
#: ``+1.2 pp``; the minus sign too).
FIGURE_PATTERNS: dict[str, re.Pattern[str]] = {
    "ratio": re.compile(rf"(?<![\w.])\d+\.\d+[x{_TIMES}](?!\w)"),
    "ratio (prefix)": re.compile(rf"(?<![\w.])[x{_TIMES}]\d+\.\d+(?![\w.])"),
    "percentage": re.compile(rf"(?<![\w.])[+\-{_MINUS}\u00b1]?\d+\.\d+\s?%"),
    "points": re.compile(rf"(?<![\w.])[+\-{_MINUS}\u00b1]\d+(?:\.\d+)?\s?(?:pts|points|pp)\b"),
}
#: On a line, lets a constant that only looks measured through the check.
ESCAPE = "not-a-figure"

_BEGIN = re.compile(r"<!-- ([A-Za-z0-9_-]+):begin -->")
_FENCE = re.compile(r"^\s*(```|~~~)")


@dataclass(frozen=True)
class Block:
    """A figure block: its marker key, the function that renders its text (without the markers) from a results
    folder, the docs (paths relative to the repository root) it belongs in, and the results files it reads
    (glob patterns)."""

    key: str
    render: Renderer
    docs: tuple[str, ...]
    sources: tuple[str, ...]

    @property
    def begin(self) -> str:
        return f"<!-- {self.key}:begin -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.key}:end -->"

    def text(self, results_dir: Path = RESULTS_DIR) -> str:
        """The whole block as it stands in a doc, markers included."""
        return f"{self.begin}\n{self.render(Path(results_dir)).strip()}\n{self.end}"


@dataclass(frozen=True)
class Problem:
    """One finding of :func:`check` (or of :func:`write`): where, what kind, and what to do."""

    path: str
    line: int
    kind: str  # "differs", "missing", "unknown block", "render failed", "unrendered figure"
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}" if self.line else f"{self.path}: {self.message}"


# ------------------------------------------------------------------------------------------------ renderers
def _marked(module: str, name: str, key: str) -> Renderer:
    """A renderer from a benchmark's own ``render(results) -> block with markers`` (chaos, conformance,
    structured_peer), markers stripped."""

    def renderer(results_dir: Path) -> str:
        import importlib

        text = importlib.import_module(module).render(load_results(results_dir, name))
        begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
        if not (text.startswith(begin) and text.rstrip().endswith(end)):
            raise ValueError(f"{module}.render() did not return a `{key}` block")
        return text.strip()[len(begin) : -len(end)].strip()

    return renderer


def _module(module: str, function: str = "render_block") -> Renderer:
    def renderer(results_dir: Path) -> str:
        import importlib

        return getattr(importlib.import_module(module), function)(results_dir)

    return renderer


def _written(results: dict[str, Any], name: str) -> str:
    when = (results.get("machine") or {}).get("time", "")[:10] or "date not recorded"
    commit = f"at commit `{results['commit']}`" if results.get("commit") else "commit not recorded"
    return f"`{name}` last written {when}, {commit}"


def render_headline(results_dir: Path = RESULTS_DIR) -> str:
    """The ``headline`` block (README.md): one line per technique with its main ratios, each linking to its card
    in docs/ and naming the results file it comes from. A technique whose results file is missing is left out."""
    results_dir = Path(results_dir)
    lines = [
        "Headline figures, each rendered from its results file in `benchmarks/results/` (the card it links to "
        "has the full tables and, for every run, its date, commit and command):",
        "",
    ]

    def item(name: str, make: Callable[[dict[str, Any]], str]) -> None:
        if (results_dir / name).exists():
            results = load_results(results_dir, name)
            lines.append(f"- {make(results)} ({_written(results, name)}).")

    def zero(r: dict[str, Any]) -> str:
        f = r["figures"]
        stages = [s for s in ("zero1", "zero2", "zero3") if s in f]
        nums = " / ".join(s[-1] for s in stages)
        return (
            f"[ZeRO](docs/zero.md): model states per rank {' / '.join(times(f[s]['state_over_ddp']) for s in stages)} "
            f"of DDP's at stages {nums}, step time {' / '.join(times(f[s]['step_time_over_ddp']) for s in stages)}"
        )

    def compression(r: dict[str, Any]) -> str:
        # One named compressor (the strategy's default), not the best of each run: which one is best moves with
        # the measurements, and a headline's words must not (tests/benchmarks/test_figures.py).
        parts = []
        for rate, per_rate in (r["figures"].get("links") or {}).items():
            ms = (per_rate.get("gpt") or {}).get("methods", {}) if isinstance(per_rate, dict) else {}
            if "speedup_vs_torch_fp16" in ms.get("powersgd", {}):
                parts.append(f"{rate} {times(ms['powersgd']['speedup_vs_torch_fp16'])}")
        return "[Gradient compression](docs/compression.md): char-GPT step speed-up of `PowerSGD(4)` (the " \
            "default compressor) over torch's fp16 hook, per link: " + ", ".join(parts)  # fmt: skip

    def bf16(results_dir: Path) -> None:
        from benchmarks.precision import results_files

        names = results_files(results_dir)
        runs = [(n, load_results(results_dir, n)) for n in names]
        runs = [(n, r) for n, r in runs if "ours-kahan" in r["figures"]]
        if not runs:
            return
        lrs = " / ".join(
            f"lr {r['config']['lr']:g}" if r.get("config", {}).get("lr") is not None else "default lr" for _, r in runs
        )
        k = [r["figures"]["ours-kahan"] for _, r in runs]
        lines.append(
            f'- [Pure bf16](docs/bf16.md): `BF16Precision("kahan")` holds {times(k[0]["state_over_fp32"])} fp32 '
            f"AdamW's model-state bytes; step time {' / '.join(times(x['step_time_over_fp32']) for x in k)} of fp32, "
            f"validation loss {' / '.join(percent(x['val_loss_over_fp32'] - 1) for x in k)} against fp32 ({lrs}) "
            f"({'; '.join(_written(r, n) for n, r in runs)})."
        )

    def distillation(r: dict[str, Any]) -> str:
        f = r["figures"]
        return (
            f"[Knowledge distillation](docs/distillation.md): student test accuracy "
            f"{points(f['transfer']['mean_gain_points'])} on the transfer set, {points(f['full']['mean_gain_points'])}"
            f" on the full split (mean of {len(f['transfer']['gain_points'])} seeds); step time "
            f"{times(f['overhead_cached'])} the student's alone with cached teacher logits"
        )

    def augmentation(r: dict[str, Any]) -> str:
        m = r["figures"]["methods"]
        return (
            f"[Batch augmentation](docs/augmentation.md): CNN test accuracy {100 * m['ours']['mean']:.2f}% with "
            f"MixUp/CutMix per sample against torchvision v2's per batch {100 * m['torchvision']['mean']:.2f}% and "
            f"none {100 * m['none']['mean']:.2f}% (mean of {len(r['figures']['seeds'])} seeds); step time "
            f"{times(m['ours']['step_vs_none'])} of no augmentation"
        )

    def data(r: dict[str, Any]) -> str:
        f = r["figures"]
        text = (
            f"[Streaming data](docs/data.md): Fashion-MNIST streamed from S3 (a local server) at "
            f"{times(f['s3_steady_vs_local_shards'])} the samples/s of the same shards on local disk once cached, "
            f"{times(f['s3_first_vs_local_shards'])} in the first epoch"
        )
        if "s3_vs_litdata_steady" in f:
            text += f"; {times(f['s3_vs_litdata_steady'])} litdata's samples/s (its faster setting)"
        return text

    def pruning(r: dict[str, Any]) -> str:
        f = r["figures"]
        top = max((k.removeprefix("cnn_magnitude_") for k in f if k.startswith("cnn_magnitude_")), key=float)
        dense = f["cnn_dense"]["test_acc"]
        latency = {
            m: f[f"{m}_structured_summary"]["latency_s"] for m in ("cnn", "mlp") if f"{m}_structured_summary" in f
        }
        structured = [f"{times(s['ours'] / s['dense'])} ({m.upper()})" for m, s in latency.items()]
        return (
            f"[Pruning](docs/pruning.md): CNN at {float(top):.0%} sparsity "
            f"{points(100 * (f[f'cnn_magnitude_{top}']['test_acc'] - dense))} against dense (Lightning's "
            f"ModelPruning {points(100 * (f[f'cnn_modelpruning_{top}']['test_acc'] - dense))}); structured, half the "
            f"channels removed: CPU inference latency {' / '.join(structured)} of dense"
        )

    def fusion(r: dict[str, Any]) -> str:
        f = r["figures"]
        models = [m for m in ("gpt", "cnn", "pointwise") if m in f]
        names = {"gpt": "char-GPT", "cnn": "CNN", "pointwise": "chain network"}
        steps = " / ".join(times(f[m]["eager"]["median_step_s"] / f[m]["fusion"]["median_step_s"]) for m in models)
        text = (
            f"[Operator fusion](docs/fusion.md): training step {steps} faster than eager "
            f"({' / '.join(names[m] for m in models)})"
        )
        if "optimizer" in f:
            text += f"; fused AdamW step {times(f['optimizer']['for-loop'] / f['optimizer']['fused'])} faster"
        return text

    def chaos(r: dict[str, Any]) -> str:
        parts = []
        if "matrix" in r:
            rows = r["matrix"]["rows"]
            same = sum(1 for x in rows if x.get("identical") and x.get("named faults fired") == x.get("kills"))
            kills = sum(x.get("kills survived", 0) for x in rows)
            parts.append(f"{same} of {len(rows)} settings rows end bit-identical after {kills} kills and resumes")
        if "overhead" in r:
            o = r["overhead"]
            parts.append(
                f"a checkpoint every {o['every']} steps costs {times(o['sync_ratio'])} (synchronous) / "
                f"{times(o['async_ratio'])} (async) step time"
            )
        return "[Fault tolerance](docs/fault_tolerance.md): " + "; ".join(parts)

    def conformance(r: dict[str, Any]) -> str:
        from benchmarks.conformance import counts

        rows = r["rows"]
        ok, refused, warned, failed = counts(rows).values()
        families = len({x["family"] for x in rows})
        cells = len({x["cell"] for x in rows})
        return (
            f"[Conformance](docs/conformance.md): {ok} of {len(rows)} cells ok ({families} model families we did "
            f"not write x {cells} settings); {refused} refused before training with the reason, {warned} trained "
            f"without the technique with a warning saying why, {failed} failed"
        )

    def planning(r: dict[str, Any]) -> str:
        planned = [x for x in r["rows"] if "plan_exact" in (x.get("evidence") or {})]
        exact = sum(bool(x["evidence"]["plan_exact"]) for x in planned)
        ranks = len(planned[0]["evidence"]["plan"]["params"]) if planned else "?"
        return (
            f"[Planning](docs/planning.md): `plan(model, devices={ranks})` predicted the model-state bytes each rank "
            f"held exactly in {exact} of {len(planned)} DDP, ZeRO, tensor- and pipeline-parallel conformance cells"
        )

    def tune(r: dict[str, Any]) -> str:
        f = r["figures"]
        return (
            f"[Tuning](docs/tune.md): a {f['trials']}-trial `bigtrain tune` study of the CNN in "
            f"{f['study_seconds'] / 60:.1f} minutes on 2 CPU cores, {100 * f['pruned_fraction']:.0f}% of trials pruned "
            f"early; its best configuration {100 * f['best']['mean_acc']:.2f}% validation accuracy against the "
            f"defaults' {100 * f['defaults']['mean_acc']:.2f}% (mean of {len(f['seeds'])} seeds, same budget)"
        )

    def parallel(r: dict[str, Any]) -> str:
        f = r["figures"]
        tp2, ddp = f["tp2"], f["ddp"]
        states = max(tp2["model_state_bytes_per_rank"]) / max(ddp["model_state_bytes_per_rank"])
        return (
            f"[Tensor parallelism](docs/parallel.md): at `tensor_parallel=2` the automatic split covers "
            f"{100 * tp2['sharded_fraction']:.1f}% of the char-GPT's block parameters, model states per rank "
            f"x{states:.2f} DDP's; states and tensor-parallel bytes x{tp2['states_over_planner']:.3f} / "
            f"x{tp2['tp_bytes_over_planner']:.3f} the planner's; throughput x{tp2['throughput_over_ddp']:.2f} DDP's on "
            "2 CPU cores. [Pipeline parallelism](docs/parallel.md#pipeline-parallelism) (`pipeline_parallel=2`, 1F1B): "
            + _pipeline_headline(f)
        )

    def _pipeline_headline(f: dict[str, Any]) -> str:
        pp2, ddp = f.get("pp2"), f["ddp"]
        if pp2 is None:
            return "not measured yet"
        states = max(pp2["model_state_bytes_per_rank"]) / max(ddp["model_state_bytes_per_rank"])
        return (
            f"model states per rank x{states:.2f} DDP's, x{pp2['states_over_planner']:.3f} the planner's; bytes sent "
            f"x{pp2['pp_bytes_over_planner']:.3f} the planner's; bubble {pp2['bubble_median']:.3f} from the measured "
            f"per-action times (planner {pp2['planner']['bubble']:.3f}); throughput x{pp2['throughput_over_ddp']:.2f} "
            "DDP's"
        )

    item("zero.json", zero)
    item("parallel.json", parallel)
    item("compression.json", compression)
    bf16(results_dir)
    item("distillation.json", distillation)
    item("pruning.json", pruning)
    item("augmentation.json", augmentation)
    item("data.json", data)
    item("fusion.json", fusion)
    item("chaos.json", chaos)
    item("conformance.json", conformance)
    item("conformance.json", planning)
    item("tune.json", tune)
    return "\n".join(lines)


_RESULTS_OF_HEADLINE = ("zero.json", "compression.json", "precision*.json", "distillation.json", "pruning.json",
                        "augmentation.json", "data.json", "fusion.json", "chaos.json", "conformance.json",
                        "tune.json", "parallel.json")  # fmt: skip

#: Every figure block, by key: its renderer, the docs it belongs in, the results files it reads.
BLOCKS: dict[str, Block] = {
    b.key: b
    for b in (
        Block("headline", render_headline, ("README.md",), _RESULTS_OF_HEADLINE),
        Block("zero", _module("benchmarks.zero"), ("docs/zero.md",), ("zero.json",)),
        Block("zero-memory", _module("benchmarks.zero_memory"), ("docs/zero.md",), ("zero_memory.json",)),
        Block(
            "zero-allocator",
            _module("benchmarks.zero", "render_allocator_block"),
            ("docs/zero.md",),
            ("zero_allocator.json",),
        ),
        Block(
            "activation-checkpointing",
            _module("benchmarks.activation_checkpointing"),
            ("docs/zero.md",),
            ("activation_checkpointing.json",),
        ),
        Block(
            "zero-fits",
            _module("benchmarks.zero_memory", "render_fits_block"),
            ("docs/zero.md",),
            ("zero_fits.json",),
        ),
        Block("ddp", _module("benchmarks.ddp"), ("docs/zero.md",), ("ddp.json",)),
        Block("precision", _module("benchmarks.precision"), ("docs/bf16.md",), ("precision*.json",)),
        Block("compression", _module("benchmarks.compression"), ("docs/compression.md",), ("compression.json",)),
        Block(
            "compression-auto",
            _module("benchmarks.compression", "render_auto_block"),
            ("docs/compression.md",),
            ("compression_auto.json",),
        ),
        Block(
            "compression-onebit-adam",
            _module("benchmarks.compression", "render_onebit_adam_link_block"),
            ("docs/compression.md",),
            ("compression_onebit_adam.json",),
        ),
        Block(
            "compression-nodes",
            _module("benchmarks.compression", "render_nodes_block"),
            ("docs/compression.md",),
            ("compression_nodes.json",),
        ),
        Block(
            "onebit-adam",
            _module("benchmarks.onebit_adam"),
            ("docs/compression.md",),
            ("onebit_adam.json", "onebit_adam_squares.json"),
        ),
        Block(
            "onebit-adam-factors",
            _module("benchmarks.onebit_adam", "render_factors_block"),
            ("docs/compression.md",),
            ("onebit_adam_factors.json",),
        ),
        Block(
            "zero2-compression",
            _module("benchmarks.onebit_adam", "render_zero2_block"),
            ("docs/compression.md",),
            ("zero2_compression.json",),
        ),
        Block(
            "compression-quality",
            _module("benchmarks.compression", "render_quality_block"),
            ("docs/compression.md",),
            ("compression.json",),
        ),
        Block("distillation", _module("benchmarks.distillation"), ("docs/distillation.md",), ("distillation.json",)),
        Block("pruning", _module("benchmarks.pruning"), ("docs/pruning.md",), ("pruning.json",)),
        Block("augmentation", _module("benchmarks.augmentation"), ("docs/augmentation.md",), ("augmentation.json",)),
        Block("data", _module("benchmarks.data"), ("docs/data.md",), ("data.json",)),
        Block("tune", _module("benchmarks.tune"), ("docs/tune.md",), ("tune.json",)),
        Block("parallel", _module("benchmarks.parallel"), ("docs/parallel.md",), ("parallel.json",)),
        Block("tune-gpt", _module("benchmarks.tune", "render_gpt_block"), ("docs/tune.md",), ("tune_gpt.json",)),
        Block("randaugment", _module("benchmarks.randaugment"), ("docs/augmentation.md",), ("randaugment.json",)),
        Block(
            "structured-peer",
            _marked("benchmarks.structured_peer", "structured_peer.json", "structured-peer"),
            ("docs/pruning.md",),
            ("structured_peer.json",),
        ),
        Block("fusion", _module("benchmarks.fusion"), ("docs/fusion.md",), ("fusion.json",)),
        Block(
            "chaos-figures",
            _marked("benchmarks.chaos", "chaos.json", "chaos-figures"),
            ("docs/fault_tolerance.md",),
            ("chaos.json",),
        ),
        Block(
            "conformance",
            _marked("benchmarks.conformance", "conformance.json", "conformance"),
            ("docs/conformance.md",),
            ("conformance.json",),
        ),
    )
}


def render(key: str, results_dir: Path = RESULTS_DIR) -> str:
    """The block ``key`` as it stands in a doc, markers included."""
    return BLOCKS[key].text(results_dir)


# ------------------------------------------------------------------------------------------------ docs
def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown file under docs/."""
    root = Path(root)
    readme = [root / "README.md"] if (root / "README.md").exists() else []
    return readme + sorted((root / "docs").rglob("*.md"))


def _rel(path: Path, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return str(path)


def find_blocks(text: str) -> list[tuple[str, int, int]]:
    """``(key, start, stop)`` of every marker block in ``text`` (``text[start:stop]`` is the block, markers
    included); a begin marker without its end marker has ``stop == -1``."""
    found = []
    for m in _BEGIN.finditer(text):
        end = f"<!-- {m.group(1)}:end -->"
        stop = text.find(end, m.end())
        found.append((m.group(1), m.start(), -1 if stop < 0 else stop + len(end)))
    return found


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _selected(keys: Iterable[str] | None, sources: Iterable[str] | None) -> list[Block]:
    blocks = list(BLOCKS.values())
    if keys is not None:
        unknown = set(keys) - set(BLOCKS)
        if unknown:
            raise KeyError(f"no figure block named {', '.join(sorted(unknown))}; known: {', '.join(BLOCKS)}")
        blocks = [b for b in blocks if b.key in set(keys)]
    if sources is not None:
        names = list(sources)
        blocks = [b for b in blocks if any(fnmatch.fnmatch(n, pat) for n in names for pat in b.sources)]
    return blocks


def _renderings(blocks: Sequence[Block], results_dir: Path) -> tuple[dict[str, str], list[Problem]]:
    """Each block's rendering, and a problem for each block that failed to render."""
    texts, problems = {}, []
    for b in blocks:
        try:
            texts[b.key] = b.text(results_dir)
        except Exception as err:
            where = b.docs[0] if b.docs else "benchmarks/figures.py"
            problems.append(Problem(where, 0, "render failed", f"block `{b.key}` could not be rendered: "
                                    f"{type(err).__name__}: {err}"))  # fmt: skip
    return texts, problems


def write(
    keys: Iterable[str] | None = None,
    sources: Iterable[str] | None = None,
    root: Path = ROOT,
    results_dir: Path = RESULTS_DIR,
) -> list[Problem]:
    """Rewrite the figure blocks (all, those named in ``keys``, or those reading any of the results files named
    in ``sources``) wherever they stand in README.md and docs/*.md. Blocks missing from their docs cannot be
    placed and are returned as problems (with blocks that failed to render); nothing is raised."""
    root = Path(root)
    blocks = _selected(keys, sources)
    texts, problems = _renderings(blocks, Path(results_dir))
    seen: dict[str, set[str]] = {b.key: set() for b in blocks}
    for path in doc_files(root):
        rel, text = _rel(path, root), path.read_text()
        new, changed = text, set()
        for key, start, stop in reversed(find_blocks(text)):
            if key in texts and stop >= 0:
                seen[key].add(rel)
                if text[start:stop] != texts[key]:
                    new, changed = new[:start] + texts[key] + new[stop:], changed | {key}
        if new != text:
            path.write_text(new)
            print(f"rendered {', '.join(sorted(changed))} in {rel}")
    for b in blocks:
        for doc in b.docs:
            if b.key in texts and doc not in seen[b.key]:
                problems.append(Problem(doc, 0, "missing", f"no `{b.key}` block ({b.begin} ... {b.end}) to render"))
    return problems


def check(
    root: Path = ROOT, results_dir: Path = RESULTS_DIR, code: Sequence[str] = ("lightning_bigtrain",)
) -> list[Problem]:
    """Everything that keeps the docs from being the rendering of the results: blocks whose text differs from
    their rendering, registered blocks missing from their docs, blocks with no renderer or no end marker,
    blocks that fail to render, and measured-looking figures in README.md and docs/*.md outside the blocks and
    fenced code, or in the docstrings and comments of the Python packages in ``code``."""
    root = Path(root)
    texts, problems = _renderings(list(BLOCKS.values()), Path(results_dir))
    present: dict[str, set[str]] = {key: set() for key in BLOCKS}
    for path in doc_files(root):
        rel, text = _rel(path, root), path.read_text()
        for key, start, stop in find_blocks(text):
            line = _line(text, start)
            if stop < 0:
                problems.append(Problem(rel, line, "unknown block", f"`<!-- {key}:begin -->` has no end marker"))
            elif key not in BLOCKS:
                problems.append(Problem(rel, line, "unknown block", f"block `{key}` has no renderer in "
                                        "benchmarks/figures.py (a figure no benchmark produces)"))  # fmt: skip
            else:
                present[key].add(rel)
                if key in texts and text[start:stop] != texts[key]:
                    problems.append(Problem(rel, line, "differs", f"block `{key}` differs from its rendering from "
                                            "the results (`python -m benchmarks.figures` rewrites it)"))  # fmt: skip
        problems += unrendered_in_markdown(text, rel)
    for b in BLOCKS.values():
        for doc in b.docs:
            if doc not in present[b.key]:
                why = "" if (root / doc).exists() else " (the file does not exist)"
                problems.append(Problem(doc, 0, "missing", f"block `{b.key}` ({b.begin} ... {b.end}) is missing{why}"))
    for package in code:
        for path in sorted((root / package).rglob("*.py")):
            problems += unrendered_in_python(path.read_text(), _rel(path, root))
    return problems


# ------------------------------------------------------------------------------------------------ scanning
def _figures(line: str) -> list[str]:
    if ESCAPE in line:
        return []
    return [m.group(0) for pattern in FIGURE_PATTERNS.values() for m in pattern.finditer(line)]


def _unrendered(path: str, number: int, line: str, where: str) -> list[Problem]:
    found = _figures(line)
    if not found:
        return []
    message = (f"unrendered figure {', '.join(found)} {where} (render it from a results file in a block, or "
               f"mark a constant `{ESCAPE}`): {line.strip()[:160]}")  # fmt: skip
    return [Problem(path, number, "unrendered figure", message)]


def unrendered_in_markdown(text: str, path: str = "<markdown>") -> list[Problem]:
    """Measured-looking figures in Markdown ``text`` outside figure blocks and fenced code, one problem per line."""
    spans = [(start, stop) for _, start, stop in find_blocks(text) if stop >= 0]
    problems: list[Problem] = []
    offset, fenced = 0, False
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        inside = any(start <= offset < stop for start, stop in spans)
        offset += len(line)
        if inside:
            continue
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            problems += _unrendered(path, number, line, "in prose")
    return problems


def unrendered_in_python(source: str, path: str = "<python>") -> list[Problem]:
    """Measured-looking figures in the docstrings and comments of Python ``source``, one problem per line."""
    lines = source.splitlines()
    hits: dict[int, tuple[str, str]] = {}  # line -> (the text scanned, where)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                hits[tok.start[0]] = (tok.string, "in a comment")
        tree = ast.parse(source)
    except (SyntaxError, tokenize.TokenError):
        return []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                for number in range(first.lineno, (first.end_lineno or first.lineno) + 1):
                    hits[number] = (lines[number - 1], "in a docstring")  # these lines hold the docstring only
    problems: list[Problem] = []
    for number in sorted(hits):
        text, where = hits[number]
        problems += _unrendered(path, number, text, where)
    return problems


# ------------------------------------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="report, rewrite nothing; exit 1 on any problem")
    parser.add_argument("--keys", nargs="+", choices=list(BLOCKS), help="only these blocks (writing)")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository whose README.md and docs/ to use")
    parser.add_argument("--list", action="store_true", help="print each block key, its docs and results files")
    args = parser.parse_args(argv)
    if args.list:
        for b in BLOCKS.values():
            print(f"{b.key}: {', '.join(b.docs)} <- {', '.join(b.sources)}")
        return 0
    if args.check:
        problems = check(args.root, args.results_dir)
        for p in problems:
            print(p)
        print(
            f"{len(problems)} problem(s)" if problems else "every figure block is its rendering; no unrendered figures"
        )
        return 1 if problems else 0
    problems = write(args.keys, None, args.root, args.results_dir)
    for p in problems:
        print(f"warning: {p}")
    return 0


def rewrite_block(key: str, results_dir: Path = RESULTS_DIR) -> bool:
    """Re-render block ``key`` wherever the registry places it, warning (not raising) about problems, so a long
    benchmark run is never lost at its end; True when every doc that should hold the block has it."""
    problems = write(keys=[key], results_dir=results_dir)
    for problem in problems:
        print(f"warning: {problem}")
    return not problems


if __name__ == "__main__":
    sys.exit(main())
