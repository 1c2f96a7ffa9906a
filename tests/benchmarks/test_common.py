"""The benchmark harness: alternation order, summaries, ratios, result files; a quick real run."""

from __future__ import annotations

import json

import pytest

from benchmarks import ddp
from benchmarks.common import alternate, ratio, summarize, write_results


def test_alternate_flips_the_order_every_round():
    order: list[str] = []
    out = alternate({"a": lambda: order.append("a") or 1, "b": lambda: order.append("b") or 2}, repeats=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert out == {"a": [1, 1, 1, 1], "b": [2, 2, 2, 2]}
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        alternate({"a": lambda: 1}, repeats=0)


def test_summaries_and_ratios():
    s = summarize([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    assert ratio(3.0, 2.0) == 1.5
    with pytest.raises(ZeroDivisionError):
        ratio(1.0, 0.0)
    with pytest.raises(ValueError):
        summarize([])


def test_write_results_keeps_one_row_per_area(tmp_path):
    write_results("x", {"figures": {"r": 1.0}}, "r = 1.00", tmp_path)
    write_results("a", {"figures": {}}, "first", tmp_path)
    write_results("x", {"figures": {"r": 2.0}}, "r = 2.00", tmp_path)
    rows = [
        line
        for line in (tmp_path / "README.md").read_text().splitlines()
        if line.startswith("| ") and "area" not in line
    ]
    assert len(rows) == 2 and rows[0].startswith("| a |") and "r = 2.00" in rows[1]
    data = json.loads((tmp_path / "x.json").read_text())
    assert data["figures"]["r"] == 2.0 and data["machine"]["cpu_count"] >= 1


@pytest.mark.integration
def test_ddp_benchmark_quick_run(tmp_path):
    figures = ddp.main(["--quick", "--models", "cnn", "--results-dir", str(tmp_path)])  # the plumbing, not figures
    for model in ("cnn",):
        assert figures[model]["single_samples_per_s"]["median"] > 0
        assert len(figures[model]["ddp2_peak_rss_mib_per_rank"]) == 2
    assert (tmp_path / "ddp.json").exists()


def test_chaos_rows_added_later_keep_the_others_and_say_which_run_measured_each(tmp_path):
    """`python -m benchmarks.chaos --rows NEW --merge`: the new rows in the settings order among the file's others,
    each row tagged with its run, and the rendered block names both runs."""
    import argparse
    import json

    from benchmarks.chaos import _merged_rows, _previous_rows, render

    old_run = {"commit": "aaaaaaa", "command": "python -m benchmarks.chaos", "time": "2026-12-01T00:00:00Z"}
    old = {"runs": {"matrix": old_run},
           "matrix": {"rows": [{"row": "a", "identical": True, "kills survived": 4},
                               {"row": "c", "identical": True, "kills survived": 4}]}}  # fmt: skip
    (tmp_path / "chaos.json").write_text(json.dumps(old))
    kept = _previous_rows(argparse.Namespace(results_dir=tmp_path))
    new_run = {"commit": "bbbbbbb", "command": "python -m benchmarks.chaos --rows b --merge", "time": "2026-12-07"}
    rows = _merged_rows(kept, [{"row": "b", "identical": False, "kills survived": 3}], new_run, ["a", "b", "c"])
    assert [r["row"] for r in rows] == ["a", "b", "c"]
    assert [r["run"]["commit"] for r in rows] == ["aaaaaaa", "bbbbbbb", "aaaaaaa"]
    text = render({"runs": {"matrix": new_run}, "matrix": {"rows": rows, "rows_planned": 3}})
    assert "Rows measured in 2 runs: a, c: 2026-12-01, commit `aaaaaaa`" in text
    assert "b: 2026-12-07, commit `bbbbbbb`, `python -m benchmarks.chaos --rows b --merge`" in text
    assert "| b |" in text and "**no**" in text
