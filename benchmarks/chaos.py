"""Crash consistency under every settings row, and what checkpointing costs (sync vs async).

    python -m benchmarks.chaos [--quick] [--parts matrix overhead] [--rows ROW ...] [--kills N] [--seed S]

``matrix``: for every row of the settings table (``tests/helpers/settings.py``: DDP, ZeRO 1/2/3, DeepSpeed 2/3,
compressed DDP and ZeRO-1, bf16 Kahan/stochastic, distillation, magnitude and structured pruning) the chaos
harness (``tests/helpers/chaos.py``) runs the uninterrupted 2-rank fit, then ``kills`` jobs each SIGKILLed as a
whole at a seeded fault point (inside a step, at a batch start, inside a checkpoint save before its commit,
right after a commit), then a job that finishes; checkpoints are Lightning's ``ModelCheckpoint(
every_n_train_steps=2, save_last=True)``, mid-epoch (3 steps per epoch), every job started with
``ckpt_path="last"``. A row passes when every fault killed its job and the final parameters and buffers of every
rank equal the uninterrupted run's bit for bit.

``overhead``: see :mod:`benchmarks.chaos_overhead`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, command_line, print_table, provenance, runs_line, times, write_results


def _fault_name(fault: tuple[str, int, int]) -> str:
    point, step, rank = fault
    return f"timed@{step / 1000:.1f}s" if point == "timed" else f"{point}@{step}/r{rank}"


def matrix(rows: list[str], kills: int, seed: int, timed: int, done: Any = None) -> list[dict[str, Any]]:
    from tests.helpers.chaos import run_chaos

    out = []
    for i, name in enumerate(rows):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                r = run_chaos(name, Path(tmp), kills=kills, seed=seed + i, timed=timed)
                named = [f for f in r.faults if f[0] != "timed"]
                row = {
                    "row": name,
                    "faults": " ".join(_fault_name(f) for f in r.faults),
                    "kills": len(named),
                    "named faults fired": sum(1 for rc in r.returncodes[: len(named)] if rc == -9),
                    "kills survived": r.kills_survived,
                    "mid-epoch resumes": r.mid_epoch_resumes,
                    "identical": r.identical,
                    "max abs diff": r.max_abs_diff,
                    "seconds": r.seconds,
                    "notes": "; ".join(r.notes),
                }
            except Exception as err:  # a row that fails is reported, and the others still run
                row = {"row": name, "kills": kills, "kills survived": 0, "identical": False,
                       "notes": f"{type(err).__name__}: {str(err)[-400:]}"}  # fmt: skip
        print(f"{name}: {row}", flush=True)
        out.append(row)
        if done is not None:
            done(out)  # results written after every row: a long run stopped early keeps what it measured
    return out


README = Path(__file__).resolve().parents[1] / "README.md"
_BEGIN, _END = "<!-- chaos-figures:begin -->", "<!-- chaos-figures:end -->"


def render(results: dict[str, Any]) -> str:
    """The crash-consistency figure block (``chaos-figures``, docs/fault_tolerance.md), markers included, from
    ``results/chaos.json`` (never typed by hand): each part's run (date, commit, command; what the file does not
    record is said to be not recorded), the matrix and the checkpoint overhead."""
    parts = [p for p in ("matrix", "overhead") if p in results]
    lines = [_BEGIN, runs_line(results, "chaos.json", parts), ""]
    if "matrix" in results:
        rows = results["matrix"]["rows"]
        by_run: dict[tuple[str, str, str], list[str]] = {}
        for r in rows:
            run = r.get("run") or {}
            key = ((run.get("time") or "")[:10], run.get("commit") or "", run.get("command") or "")
            by_run.setdefault(key, []).append(r["row"])
        if len(by_run) > 1:  # rows added later (`--rows ... --merge`): each group's own run
            groups = []
            for (date, commit, command), names in by_run.items():
                which = ", ".join(names) if len(names) <= 4 else f"{len(names)} rows"
                groups.append(f"{which}: {date or 'date not recorded'}, commit `{commit or 'not recorded'}`, "
                              f"`{command or 'command not recorded'}`")  # fmt: skip
            lines += [f"Rows measured in {len(by_run)} runs: {'; '.join(groups)}.", ""]
        lines += ["| settings row | faults (point@step/rank; timed: seconds after launch) | kills survived | "
                  "mid-epoch resumes | bit-identical |", "|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            survived = str(r.get("kills survived", 0))
            same = "yes" if r.get("identical") else "**no**"
            lines.append(f"| {r['row']} | {r.get('faults', r.get('notes', ''))} | {survived} | "
                         f"{r.get('mid-epoch resumes', '')} | {same} |")  # fmt: skip
        planned = results["matrix"].get("rows_planned", len(rows))
        if len(rows) < planned:
            lines.append(f"{len(rows)} of {planned} settings rows measured (the run was stopped before the rest).")
        lines.append("")
    if "overhead" in results:
        o = results["overhead"]
        lines.append(f"Checkpoint every {o['every']} steps, ZeRO-3 char-GPT {o['psi'] / 1e6:.1f}M parameters, "
                     f"2 CPU ranks: step time **{times(o['sync_ratio'])}** with synchronous saves and "
                     f"**{times(o['async_ratio'])}** with `async_checkpoint=True`, "
                     "against no checkpoints.")  # fmt: skip
    lines.append(_END)
    return "\n".join(lines)


def render_readme(results_path: Path = RESULTS_DIR / "chaos.json", readme: Path = README) -> bool:
    """Re-render the ``chaos-figures`` block from ``results_path`` wherever it stands in README.md and docs/*.md
    (:func:`benchmarks.figures.write`; ``readme`` is kept for callers, the docs are found by the registry).
    True when every doc that should hold the block has it."""
    from benchmarks.figures import rewrite_block

    return rewrite_block("chaos-figures", results_path.parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two rows, two kills each")
    parser.add_argument("--parts", nargs="+", default=["matrix", "overhead"], choices=["matrix", "overhead"])
    parser.add_argument("--rows", nargs="+", default=None, help="settings rows (default: all)")
    parser.add_argument("--kills", type=int, default=3, help="named fault points per row")
    parser.add_argument("--timed", type=int, default=1, help="kills at seeded random moments per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="overhead: alternating rounds")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--render", action="store_true", help="only re-render the README block from the results")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other part's figures from the existing results file (with --rows: the "
                             "other rows too)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.render:
        render_readme(args.results_dir / "chaos.json")
        return 0
    from tests.helpers.settings import SETTINGS

    command = command_line("benchmarks.chaos", argv)
    run = provenance(command)
    payload: dict[str, Any] = {"commands": {part: command for part in args.parts},
                               "runs": {part: run for part in args.parts}, "command": command}  # fmt: skip
    if "matrix" in args.parts:
        rows = args.rows or ([s.name for s in SETTINGS] if not args.quick else ["ddp_cnn", "zero3_gpt"])
        kills = 2 if args.quick else args.kills

        # With --merge and --rows: these rows (re)measured, the other rows of the existing file kept.
        kept = _previous_rows(args) if args.merge and args.rows else None
        order = [s.name for s in SETTINGS]

        def partial(table: list[dict[str, Any]]) -> None:
            full = table if kept is None else _merged_rows(kept, table, run, order)
            planned = len(rows) if kept is None else len(_merged_rows(kept, [{"row": r} for r in rows], run, order))
            payload["matrix"] = {"kills_per_row": kills, "timed_per_row": args.timed, "seed": args.seed,
                                 "rows": full, "rows_planned": planned}  # fmt: skip
            _write(args, payload)

        table = matrix(rows, kills, args.seed, 0 if args.quick else args.timed, partial)
        print_table(table, ["row", "faults", "kills survived", "mid-epoch resumes", "identical"])
        partial(table)
    if "overhead" in args.parts:
        from benchmarks.chaos_overhead import overhead

        result = overhead(quick=args.quick, repeats=args.repeats)
        payload["overhead"] = result
    _write(args, payload)
    return 0


def _previous_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The existing file's matrix rows, each tagged with the run that measured it (the file's matrix run where the
    row has none of its own)."""
    import json

    previous = args.results_dir / "chaos.json"
    old: dict[str, Any] = json.loads(previous.read_text()) if previous.exists() else {}
    old_run = (old.get("runs") or {}).get("matrix") or {"command": (old.get("commands") or {}).get("matrix")}
    return [{**r, "run": r.get("run") or old_run} for r in (old.get("matrix") or {}).get("rows", [])]


def _merged_rows(
    kept: list[dict[str, Any]], table: list[dict[str, Any]], run: dict[str, Any], order: list[str]
) -> list[dict[str, Any]]:
    """The rows just measured (each tagged with this run) in place of, or added to, the ``kept`` rows, in the settings
    table's order."""
    rows = {r["row"]: r for r in kept}
    for r in table:
        rows[r["row"]] = {**r, "run": run}
    rank = {name: i for i, name in enumerate(order)}
    return sorted(rows.values(), key=lambda r: rank.get(r["row"], len(rank)))


def _write(args: argparse.Namespace, payload: dict[str, Any]) -> None:
    area = "chaos" if not args.quick else "chaos_quick"
    payload = dict(payload)
    previous = args.results_dir / f"{area}.json"
    if args.merge and previous.exists():
        import json

        old = json.loads(previous.read_text())
        old_commands = old.get("commands") or {p: old["command"] for p in ("matrix", "overhead") if p in old}
        old_runs = old.get("runs") or {}
        for part in ("matrix", "overhead"):
            if part not in payload and part in old:
                payload[part] = old[part]
                payload["commands"] = {**payload["commands"], part: old_commands[part]}
                payload["runs"] = {**payload["runs"], part: old_runs.get(part, {"command": old_commands[part]})}
    write_results(area, payload, _headline(payload), args.results_dir)  # re-renders the docs' block


def _headline(payload: dict[str, Any]) -> str:
    parts = []
    if "matrix" in payload:
        table = payload["matrix"]["rows"]
        ok = sum(1 for r in table if r["identical"] and r.get("named faults fired") == r["kills"])
        parts.append(f"{ok}/{len(table)} rows bit-identical after {sum(r['kills survived'] for r in table)} kills")
    if "overhead" in payload:
        o = payload["overhead"]
        parts.append(f"checkpoint every {o['every']} steps: sync x{o['sync_ratio']:.3f}, async x{o['async_ratio']:.3f}")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
