"""Shared benchmark harness: A/B alternation, medians, ratios, machine info, JSON and README output.

Protocol (DESIGN.md section 7): our component and its peer run in the same invocation, alternating
(A B B A ...) so slow drift of the machine hits both alike; we report medians over repeats and ratios
ours / peer. Absolute times are printed for context but never asserted anywhere.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]

__all__ = [
    "RESULTS_DIR",
    "ROOT",
    "alternate",
    "command_line",
    "count",
    "load_results",
    "machine_info",
    "measured_line",
    "merge_runs",
    "percent",
    "points",
    "print_table",
    "provenance",
    "ratio",
    "run_worker",
    "runs_line",
    "set_flush_denormal",
    "sig",
    "summarize",
    "times",
    "write_results",
    "zero_benchmark_model",
]


def set_flush_denormal() -> None:
    """Flush denormals to zero: losses decaying toward zero otherwise swing CPU timings up to 10x."""
    import torch

    torch.set_flush_denormal(True)


def zero_benchmark_model(quick: bool) -> tuple[Any, Any, int]:
    """The ZeRO benchmarks' char-GPT on Shakespeare, seeded: 25M parameters (8 layers, width 512), ``quick``: 2
    layers, width 128; batch 4 of 128 characters. Returns the datamodule, the model and its parameter count."""
    import lightning as L

    from lightning_bigtrain.data import ShakespeareDataModule
    from lightning_bigtrain.models import CharGPT

    set_flush_denormal()
    L.seed_everything(0, verbose=False)
    data = ShakespeareDataModule(block_size=128, batch_size=4)
    width, layers = (128, 2) if quick else (512, 8)
    model = CharGPT(vocab_size=data.vocab_size, block_size=128, n_layer=layers, n_head=8, n_embd=width)
    return data, model, sum(p.numel() for p in model.parameters())


def machine_info() -> dict[str, Any]:
    """What the figures were measured on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and count of repeated measurements (the values themselves kept too)."""
    if not values:
        raise ValueError("summarize() needs at least one value.")
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": list(values),
    }


def ratio(ours: float, peer: float) -> float:
    """ours / peer; a zero peer is an error, not an infinity."""
    if peer == 0:
        raise ZeroDivisionError("the peer's figure is 0; the ratio is undefined.")
    return ours / peer


def alternate(candidates: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[Any]]:
    """Run every candidate ``repeats`` times, alternating the order each round (A B, B A, A B, ...).

    Returns:
        The results of each candidate, in the order they were measured.
    """
    if repeats < 1:
        raise ValueError(f"`alternate(repeats={repeats})`: repeats must be >= 1.")
    names = list(candidates)
    results: dict[str, list[Any]] = {n: [] for n in names}
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else reversed(names):
            results[name].append(candidates[name]())
    return results


def run_worker(module: str, args: Sequence[str], timeout: float = 1800) -> dict[str, Any]:
    """Run ``python -m module *args --out FILE`` in a fresh process and return the JSON it wrote.

    Each measured configuration runs in its own process so that process launch, thread settings and
    allocator state are the same for ours and the peer.
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", module, *args, "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if not out.exists():
            raise RuntimeError(f"benchmark worker failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")
        if proc.returncode != 0:
            # The measurement finished and was written; only process teardown failed (seen: a gloo thread
            # aborting at exit). Keep the figures, say so.
            print(f"note: worker exited with code {proc.returncode} after writing its result: {' '.join(cmd)}")
        return json.loads(out.read_text())


def write_results(
    area: str, payload: dict[str, Any], headline: str, results_dir: Path = RESULTS_DIR, *, command: str | None = None
) -> Path:
    """Write ``results/<area>.json`` and set this area's row in ``results/README.md``.

    The file records the commit of the code that ran (``payload["commit"]`` if given, else :func:`git_commit`)
    and the command (``payload["command"]`` if given, else ``command``). Written to the repository's results
    folder, the figure blocks of README.md and docs/*.md that read this file are re-rendered
    (:mod:`benchmarks.figures`); a doc problem is printed, never raised (the measurement is kept).
    """
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{area}.json"
    recorded = {"commit": payload.get("commit") or git_commit() or None,
                "command": payload.get("command") or command}  # fmt: skip
    path.write_text(json.dumps({"area": area, "machine": machine_info(), **payload, **recorded}, indent=2) + "\n")
    readme = results_dir / "README.md"
    header = [
        "# Benchmark results",
        "",
        "Written by `make bench` (each `benchmarks/<area>.py`); ratios are ours / peer, medians over repeats.",
        "",
        "| area | headline | measured | file |",
        "|---|---|---|---|",
    ]
    rows = {}
    if readme.exists():
        for line in readme.read_text().splitlines():
            if line.startswith("| ") and not line.startswith(("| area", "|---")):
                rows[line.split("|")[1].strip()] = line
    rows[area] = f"| {area} | {headline} | {time.strftime('%Y-%m-%d')} | [{path.name}]({path.name}) |"
    readme.write_text("\n".join(header + [rows[k] for k in sorted(rows)]) + "\n")
    if results_dir.resolve() == RESULTS_DIR.resolve():
        try:
            from benchmarks.figures import write as write_figures

            write_figures(sources=[path.name])
        except Exception as err:  # the figures are written; the docs can be rendered later (make figures)
            print(f"note: the doc figures were not re-rendered ({type(err).__name__}: {err}); run `make figures`")
    return path


def replace_block(readme: Path, begin: str, end: str, block: str) -> bool:
    """Replace the text from ``begin`` to ``end`` (markers included) in ``readme`` by ``block``; True if it changed."""
    text = readme.read_text()
    start, stop = text.index(begin), text.index(end) + len(end)
    new = text[:start] + block + text[stop:]
    readme.write_text(new)
    return new != text


def git_commit() -> str:
    """The short commit of the code being run (recorded with the figures)."""
    import subprocess

    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()  # fmt: skip


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The command as a user types it: ``python -m <module> <argv>`` (``argv`` None: this process's arguments)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])


def provenance(command: str) -> dict[str, Any]:
    """Where a run's figures come from: the commit of the code, the command and the time (UTC)."""
    return {"commit": git_commit() or None, "command": command,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip


def merge_runs(previous: dict[str, Any] | None, parts: Sequence[str], run: dict[str, Any]) -> dict[str, Any]:
    """``{part: provenance}`` of a results file whose parts can be re-run separately (``--parts``): the parts
    run now get ``run``, the others keep the entry of the ``previous`` results file (``{}`` where it had none)."""
    runs = {k: dict(v) for k, v in ((previous or {}).get("runs") or {}).items()}
    for part in parts:
        runs[part] = dict(run)
    return runs


# ---------------------------------------------------------------------------------------- figure rendering
def load_results(results_dir: Path, name: str) -> dict[str, Any]:
    """``results_dir/name`` parsed; a missing file is an error naming the benchmark that writes it."""
    path = Path(results_dir) / name
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: run the benchmark that writes it (benchmarks/results/README.md lists each file's "
            f"area; most are `python -m benchmarks.{name.split('_lr')[0].split('.')[0]}`, the `--area` runs of "
            "benchmarks.compression and benchmarks.onebit_adam write the others)"
        )
    return json.loads(path.read_text())


def sig(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant digits (trailing zeros kept: 1.00, 0.500; integers above that precision
    are rounded to units, not to powers of ten: 2995, not 3.00e+03)."""
    if not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) >= 10 ** (digits - 1):
        return f"{x:.0f}"
    return f"{x:#.{digits}g}".rstrip(".")


def count(n: float) -> str:
    """A count such as a number of parameters: ``25.4M``, ``94.2k``, ``512``."""
    if abs(n) >= 1e6:
        return f"{sig(n / 1e6)}M"
    return f"{sig(n / 1e3)}k" if abs(n) >= 1e3 else sig(n)


def times(x: float, digits: int = 3) -> str:
    """A ratio as ``1.23x``."""
    return f"{sig(x, digits)}x"


def points(x: float) -> str:
    """A difference in percentage points, signed: ``+0.65 pts``, ``-8.73 pts``."""
    return f"{x:+.2f} pts" if abs(x) < 10 else f"{x:+.1f} pts"


def percent(fraction: float, digits: int = 2) -> str:
    """A relative change, signed, to ``digits`` significant digits: 0.1385 -> ``+14%``, 0.00081 -> ``+0.081%``."""
    return ("+" if fraction >= 0 else "-") + sig(abs(100 * fraction), digits) + "%"


def _display_path(results_dir: Path, name: str) -> str:
    path = (Path(results_dir) / name).resolve()
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def _machine_text(results: dict[str, Any]) -> str:
    m = results.get("machine") or {}
    text = f"{m.get('cpu_count', '?')} CPU cores ({m.get('cpu', 'CPU not recorded')}), torch {m.get('torch', '?')}"
    return text + (f", GPU {m['cuda']}" if m.get("cuda") else ", no GPU")


def measured_line(results: dict[str, Any], name: str, results_dir: Path = RESULTS_DIR) -> str:
    """The first line of every figure block: when, at which commit, with which command, on what, from which file.
    What the file does not record is said to be not recorded."""
    when = (results.get("machine") or {}).get("time", "")[:10] or "date not recorded"
    commit = f"at commit `{results['commit']}`" if results.get("commit") else "commit not recorded"
    command = f"`{results['command']}`" if results.get("command") else "command not recorded"
    quick = " A `--quick` smoke run: the figures mean nothing." if (results.get("config") or {}).get("quick") else ""
    return (f"Measured {when}, {commit}, {command}; {_machine_text(results)} "
            f"(`{_display_path(results_dir, name)}`).{quick}")  # fmt: skip


def runs_line(results: dict[str, Any], name: str, parts: Sequence[str], results_dir: Path = RESULTS_DIR) -> str:
    """:func:`measured_line` for a file whose parts can come from separate runs (``--parts``, merged): one entry
    per run from the file's ``runs`` record (``{part: {"commit", "command", "time"}}``; older files: only
    ``commands``), or, for a file without either, that its parts' runs are not recorded."""
    when = (results.get("machine") or {}).get("time", "")[:10] or "date not recorded"
    where = f"{_machine_text(results)} (`{_display_path(results_dir, name)}`)"
    runs = results.get("runs") or {p: {"command": c} for p, c in (results.get("commands") or {}).items()}
    if not runs:
        return (f"File last written {when}; its parts ({', '.join(parts)}) can come from separate runs (`--parts`), "
                f"whose dates, commits and commands the file does not record; {where}.")  # fmt: skip
    by_run: dict[tuple[Any, Any, Any], list[str]] = {}
    for part in parts:
        r = runs.get(part)
        if r is not None:
            by_run.setdefault(((r.get("time") or "")[:10], r.get("commit"), r.get("command")), []).append(part)
    entries = []
    for (date, commit, command), names in by_run.items():
        c = f"commit `{commit}`" if commit else "commit not recorded"
        entries.append(f"{', '.join(names)}: {date or 'date not recorded'}, {c}, "
                       + (f"`{command}`" if command else "command not recorded"))  # fmt: skip
    missing = [p for p in parts if p not in runs]
    if missing:
        entries.append(f"{', '.join(missing)}: run not recorded")
    return f"Measured in {len(by_run)} run(s) ({'; '.join(entries)}); file last written {when}; {where}."


def print_table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain Markdown table of ``rows`` (dicts) restricted to ``columns``; printed and returned."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _sent_to_others(payload: Any, splits: Any, world: int, group: Any) -> int:
    import torch.distributed as dist

    sizes = list(splits) if splits else [payload.numel() // world] * world
    rank = dist.get_rank(group)
    return sum(size for j, size in enumerate(sizes) if j != rank) * payload.element_size()


@contextmanager
def count_collectives(world: int, kinds: Sequence[str] | None = None) -> Iterator[dict[str, int]]:
    """Count ring-equivalent bytes this rank sends through torch.distributed collectives (an independent
    check of the strategies' own counters: it wraps the functions every engine calls). ``kinds`` limits it
    to some of the wrapped functions (names in torch.distributed), e.g. gathers and scatters only."""
    import torch.distributed as dist

    counted = {"bytes": 0}
    factor = (world - 1) / world

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    def arg(args, kwargs, index, *names):
        for name in names:
            if name in kwargs:
                return kwargs[name]
        return args[index]

    def wrap(name: str, measure):
        original = getattr(dist, name)

        def counting(*args, **kwargs):
            counted["bytes"] += int(measure(args, kwargs))
            return original(*args, **kwargs)

        return original, counting

    # Ring-equivalent bytes sent: gathers count their output, scatters their input, all-reduce twice.
    measures = {
        "all_gather_into_tensor": lambda a, k: factor * nbytes(arg(a, k, 0, "output_tensor", "output")),
        "all_gather_single": lambda a, k: factor * nbytes(arg(a, k, 0, "output_tensor", "output")),
        "reduce_scatter_tensor": lambda a, k: factor * nbytes(arg(a, k, 1, "input", "input_tensor")),
        "reduce_scatter_single": lambda a, k: factor * nbytes(arg(a, k, 1, "input", "input_tensor")),
        "all_reduce": lambda a, k: 2 * factor * nbytes(arg(a, k, 0, "tensor")),
        # List variants and reduce (DeepSpeed's engine uses them where gloo lacks the tensor forms).
        "all_gather": lambda a, k: factor * sum(map(nbytes, arg(a, k, 0, "tensor_list"))),
        "reduce_scatter": lambda a, k: factor * sum(map(nbytes, arg(a, k, 1, "input_list"))),
        "reduce": lambda a, k: factor * nbytes(arg(a, k, 0, "tensor")),
        # All-to-all (ZeRO-2's compressed reduce-scatter): what goes to the other ranks.
        "all_to_all_single": lambda a, k: _sent_to_others(
            arg(a, k, 1, "input"), k.get("input_split_sizes", a[3] if len(a) > 3 else None), world, k.get("group")
        ),
    }
    originals = {}
    for name, measure in measures.items():
        if hasattr(dist, name) and (kinds is None or name in kinds):
            originals[name], counting = wrap(name, measure)
            setattr(dist, name, counting)
    try:
        yield counted
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
