"""The figure blocks of README.md and docs/*.md are renderings of benchmarks/results/*.json (benchmarks.figures).

(a) every block renders from the committed results, starts with its provenance line, and every decimal figure it
    shows is derived from the results (it moves when the JSON's numbers move); some figures are recomputed here;
(b) ``check()`` reports a block whose text was edited, a missing block, a block no benchmark renders and a
    measured-looking figure typed outside the blocks (Markdown prose, Python docstrings and comments);
(c) the real README.md and docs/ pass ``check()`` (skipped until docs/ exists).
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from benchmarks import figures
from benchmarks.common import RESULTS_DIR, ROOT, points, sig, times
from benchmarks.figures import BLOCKS, check, render, write

KEYS = list(BLOCKS)
_NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?")
_CALL_LABEL = re.compile(r"[A-Za-z_][\w.]*\([^()]*\)")  # PowerSGD(4), TopK(0.01), StructuredPruning(0.5): labels
_CODE = re.compile(r"`[^`]*`")


def _load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS_DIR / name).read_text())


def _body(key: str, results_dir: Path = RESULTS_DIR) -> list[str]:
    """The block's lines between the markers, the provenance line (metadata: dates, versions, commands) left out."""
    return render(key, results_dir).splitlines()[2:-1]


def _decimals(lines: list[str]) -> tuple[str, list[str]]:
    """The figure tokens of ``lines`` (numbers, code spans and call-like labels left out) and the text around
    them with each number replaced by ``#`` (the skeleton, equal across renderings of perturbed results)."""
    text = _CALL_LABEL.sub("", _CODE.sub("", "\n".join(lines)))
    return _NUMBER.sub("#", text), _NUMBER.findall(text)


def _numbers_in_strings(obj: Any) -> set[str]:
    """Numbers written inside the JSON's keys and strings (``"0.5"`` as a sweep key): present in the results, so
    a block may show them though perturbing the numbers does not move them."""
    if isinstance(obj, str):
        return set(_NUMBER.findall(obj))
    if isinstance(obj, list):
        return set().union(*map(_numbers_in_strings, obj)) if obj else set()
    if isinstance(obj, dict):
        return set().union(*(_numbers_in_strings(k) | _numbers_in_strings(v) for k, v in obj.items())) if obj else set()
    return set()


#: Counts whose equality with a list's length a renderer tests (the chaos matrix: all rows run, all faults fired).
STRUCTURAL = {"rows_planned", "kills", "named faults fired"}


def _perturb(obj: Any, rng: random.Random) -> Any:
    """Every number scaled by its own random factor (integers kept integers; 0, 1 and :data:`STRUCTURAL` counts
    kept), strings and booleans kept."""
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return obj if abs(obj) < 2 else int(obj * rng.uniform(1.3, 1.9)) + 1
    if isinstance(obj, float):
        return obj * rng.uniform(1.3, 1.9)
    if isinstance(obj, list):
        return [_perturb(v, rng) for v in obj]
    return {k: v if k in STRUCTURAL else _perturb(v, rng) for k, v in obj.items()}


# ------------------------------------------------------------------------------------------------ (a)
@pytest.mark.parametrize("key", KEYS)
def test_every_block_renders_from_the_committed_results_with_its_provenance_first(key):
    text = render(key)
    lines = text.splitlines()
    assert lines[0] == f"<!-- {key}:begin -->" and lines[-1] == f"<!-- {key}:end -->"
    first = lines[1]
    assert first.startswith(("Measured", "File last written", "Headline figures")), first
    if key != "headline":
        assert "commit" in first and "benchmarks/results/" in first, first
        for source in BLOCKS[key].sources:
            assert any(p.name in first for p in RESULTS_DIR.glob(source)), (source, first)
    assert text == render(key), "rendering must be deterministic"


def _figures_not_from_the_results(body: Callable[[Path], list[str]], tmp_path: Path) -> list[str]:
    """The decimal figures of ``body(results_dir)`` that stay put when every number of the results files is moved
    by its own random factor (six draws): figures not computed from the results (typed, or constants)."""
    base_skeleton, base = _decimals(body(RESULTS_DIR))
    assert base, "the block shows no figure"
    unmoved = set(range(len(base)))
    for seed in range(6):
        perturbed = tmp_path / f"p{seed}"
        perturbed.mkdir()
        rng = random.Random(seed)
        for path in sorted(RESULTS_DIR.glob("*.json")):
            (perturbed / path.name).write_text(json.dumps(_perturb(json.loads(path.read_text()), rng)))
        skeleton, moved = _decimals(body(perturbed))
        assert skeleton == base_skeleton, "the block's text around its figures must not depend on their values"
        unmoved &= {i for i, (a, b) in enumerate(zip(base, moved, strict=True)) if a == b}
    in_strings = set().union(*(_numbers_in_strings(_load(p.name)) for p in RESULTS_DIR.glob("*.json")))
    return [base[i] for i in sorted(unmoved) if "." in base[i] and float(base[i]) != 0 and base[i] not in in_strings]


@pytest.mark.parametrize("key", KEYS)
def test_every_decimal_figure_of_a_block_comes_from_the_results(key, tmp_path):
    """Each results file is copied with every number moved by its own random factor: a decimal figure the block
    shows that does not move with them is not the results' (typed, or a constant)."""
    fixed = _figures_not_from_the_results(lambda results_dir: _body(key, results_dir), tmp_path)
    assert not fixed, f"block {key}: figures that do not come from the results: {fixed}"


def test_a_typed_figure_is_caught_by_that_test(tmp_path):
    def typed(results_dir: Path) -> list[str]:
        zero = json.loads((results_dir / "zero.json").read_text())["figures"]["zero3"]
        return [f"ZeRO-3 step {times(zero['step_time_over_ddp'])}, as fast as 0.9137x of the last release"]

    assert _figures_not_from_the_results(typed, tmp_path) == ["0.9137"]


def test_spot_checks_recomputed_from_the_json():
    zero = _load("zero.json")["figures"]
    block = render("zero")
    assert f"| {times(zero['zero3']['step_time_over_ddp'])} |" in block
    assert f"| ZeRO-1 | {sig(zero['zero1']['bytes_per_param'])} " in block
    source = _load("zero.json").get("ddp_bytes_sent_source")
    assert f"({source})" in block if source else "(formula)" in block  # older files: the ring formula

    ddp = _load("ddp.json")["figures"]["cnn"]
    assert times(ddp["ddp2_samples_per_s"]["median"] / ddp["single_samples_per_s"]["median"]) in render("ddp")

    link = _load("compression.json")["figures"]["links"]["100mbit"]["gpt"]["methods"]
    assert times(link["torch_fp16"]["step_s"] / link["powersgd"]["step_s"]) in render("compression")

    adam = _load("compression_onebit_adam.json")["figures"]["links"]["100mbit"]["gpt"]["methods"]
    adam_line = next(line for line in render("compression-onebit-adam").splitlines() if line.startswith("| 100mbit"))
    assert f"| {times(adam['torch_fp16']['step_s'] / adam['onebit_adam']['step_s'])} |" in adam_line  # the mean step
    assert f"({sig(adam['onebit_adam']['step_s_median'])} s)" in adam_line

    quality = _load("compression.json")["figures"]["quality"]
    q_block = render("compression-quality")
    gpt_line = next(line for line in q_block.splitlines() if line.startswith("| gpt"))
    cnn_line = next(line for line in q_block.splitlines() if line.startswith("| cnn"))
    assert len(quality["gpt"]["seeds"]) == 1 and "1 seed" in gpt_line and "mean of" not in gpt_line
    assert f"mean of {len(quality['cnn']['seeds'])} seeds" in cnn_line
    cnn = quality["cnn"]["methods"]
    assert f"{100 * (cnn['topk']['mean'] - cnn['fp32']['mean']):+.2f}" in cnn_line

    kahan = _load("precision_lr0.0003.json")["figures"]["ours-kahan"]
    assert times(kahan["state_over_fp32"]) in render("precision")

    distillation = _load("distillation.json")["figures"]
    d_block = render("distillation")
    gains = distillation["transfer"]["gain_points"]
    assert points(sum(gains) / len(gains)) in d_block
    assert times(distillation["overhead_cached"]) in d_block

    pruning = _load("pruning.json")["figures"]
    p_block = render("pruning")
    assert points(100 * (pruning["cnn_magnitude_0.9"]["test_acc"] - pruning["cnn_dense"]["test_acc"])) in p_block
    latency = pruning["cnn_structured_summary"]["latency_s"]
    assert f"**{times(latency['ours'] / latency['dense'])}**" in p_block

    fusion = _load("fusion.json")["figures"]["cnn"]
    assert times(fusion["eager"]["median_step_s"] / fusion["fusion"]["median_step_s"]) in render("fusion")

    chaos = _load("chaos.json")["overhead"]
    assert times(chaos["sync_ratio"]) in render("chaos-figures")
    assert times(_load("zero.json")["figures"]["zero3"]["state_over_ddp"]) in render("headline")


def test_what_a_file_does_not_record_is_said_to_be_not_recorded(tmp_path):
    for path in RESULTS_DIR.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    ddp = _load("ddp.json")
    for key in ("commit", "command"):  # as files written before both were recorded
        ddp.pop(key, None)
    (tmp_path / "ddp.json").write_text(json.dumps(ddp))
    assert "commit not recorded, command not recorded" in render("ddp", tmp_path).splitlines()[1]
    assert "at commit `b8ded6e`, `python -m benchmarks.ddp`" in render("ddp").splitlines()[1]  # it records both
    assert "at commit `95c1801`" in render("structured-peer").splitlines()[1]  # it records both
    # pruning.json merges parts run separately (--parts): a file that records none of their runs says so
    pruning = _load("pruning.json")
    for key in ("commit", "command", "runs"):
        pruning.pop(key, None)
    (tmp_path / "pruning.json").write_text(json.dumps(pruning))
    assert "whose dates, commits and commands the file does not record" in render("pruning", tmp_path).splitlines()[1]
    assert "commit `b8ded6e`, `python -m benchmarks.pruning`" in render("pruning").splitlines()[1]


def test_the_rendering_follows_what_the_file_records(tmp_path):
    """Seeds, the DDP byte count's source and per-part runs are rendered as recorded, not as assumed."""
    for path in RESULTS_DIR.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    compression = _load("compression.json")
    gpt = compression["figures"]["quality"]["gpt"]
    gpt["seeds"] = [0, 1, 2]
    for v in gpt["methods"].values():
        v["values"] = [v["mean"]] * 3
    (tmp_path / "compression.json").write_text(json.dumps(compression))
    gpt_line = next(line for line in render("compression-quality", tmp_path).splitlines() if line.startswith("| gpt"))
    assert "mean of 3 seeds" in gpt_line

    zero = _load("zero.json")
    zero.update(ddp_bytes_sent_source="comm hook", commit="abc1234", command="python -m benchmarks.zero")
    (tmp_path / "zero.json").write_text(json.dumps(zero))
    block = render("zero", tmp_path)
    assert "(comm hook)" in block and "ring formula" not in block
    assert "at commit `abc1234`, `python -m benchmarks.zero`" in block.splitlines()[1]

    pruning = _load("pruning.json")
    pruning["runs"] = {"cnn": {"commit": "aaa1111", "command": "python -m benchmarks.pruning", "time": "2027-01-02"},
                       "resnet18": {"commit": "bbb2222", "command": "python -m benchmarks.pruning --parts resnet18",
                                    "time": "2027-01-05"}}  # fmt: skip
    (tmp_path / "pruning.json").write_text(json.dumps(pruning))
    first = render("pruning", tmp_path).splitlines()[1]
    assert "cnn: 2027-01-02, commit `aaa1111`" in first and "resnet18: 2027-01-05, commit `bbb2222`" in first
    assert "structured_sweep: run not recorded" in first


# ------------------------------------------------------------------------------------------------ (b)
@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return {key: render(key) for key in KEYS}


@pytest.fixture
def repo(tmp_path, rendered) -> Path:
    """A repository whose README.md and docs/ hold exactly their rendered blocks, and a package with a module."""
    docs: dict[str, list[str]] = {}
    for block in BLOCKS.values():
        for doc in block.docs:
            docs.setdefault(doc, []).append(rendered[block.key])
    for doc, blocks in docs.items():
        path = tmp_path / doc
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"# {doc}\n\nSome prose with 3 ranks and 90% sparsity.\n\n" + "\n\nText.\n\n".join(blocks) + "\n"
        )
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text('"""A module."""\n\nRATIO = "1.5x"  # a string, not a docstring\n')
    return tmp_path


def _check(repo: Path) -> list[figures.Problem]:
    return check(repo, RESULTS_DIR, code=("pkg",))


def test_a_repository_of_rendered_blocks_passes(repo):
    assert _check(repo) == []


def test_an_edited_block_is_reported_and_write_restores_it(repo, rendered):
    doc = repo / "docs" / "zero.md"
    figure = times(_load("zero.json")["figures"]["zero3"]["step_time_over_ddp"])
    doc.write_text(doc.read_text().replace(f"| {figure} |", "| 1.20x |", 1))
    problems = _check(repo)
    assert [(p.path, p.kind) for p in problems] == [("docs/zero.md", "differs")]
    assert "`zero`" in problems[0].message and problems[0].line > 0
    assert write(root=repo, results_dir=RESULTS_DIR) == []
    assert rendered["zero"] in doc.read_text() and _check(repo) == []


def test_a_missing_block_and_a_missing_doc_are_reported(repo, rendered):
    doc = repo / "docs" / "compression.md"
    doc.write_text(doc.read_text().replace(rendered["compression-quality"], "the table went here"))
    (repo / "docs" / "fusion.md").unlink()
    found = {(p.path, p.kind, p.message.split("`")[1]) for p in _check(repo)}
    assert found == {("docs/compression.md", "missing", "compression-quality"), ("docs/fusion.md", "missing", "fusion")}
    missing = write(root=repo, results_dir=RESULTS_DIR)  # cannot place them: says so, raises nothing
    assert {(p.path, p.kind) for p in missing} == {("docs/compression.md", "missing"), ("docs/fusion.md", "missing")}


def test_a_block_no_benchmark_renders_is_reported(repo):
    doc = repo / "docs" / "planning.md"
    doc.write_text("<!-- planner-accuracy:begin -->\npeak within 0.98x\n<!-- planner-accuracy:end -->\n")
    problems = _check(repo)
    assert [(p.path, p.kind, p.line) for p in problems] == [("docs/planning.md", "unknown block", 1)]


def test_figures_typed_in_prose_are_reported_with_their_line(repo):
    doc = repo / "docs" / "bf16.md"
    doc.write_text(
        doc.read_text()
        + "\nKahan runs 1.23x faster.\nNot a figure: a 2.5x budget <!-- not-a-figure -->\n"
        + "```python\nspeedup = 1.5x  # in fenced code\n```\n"
        + "The loss rose by +13.9% and accuracy fell -0.5 pts; ratio x0.92.\n"
    )
    lines = doc.read_text().splitlines()
    problems = [p for p in _check(repo) if p.kind == "unrendered figure"]
    assert [(p.path, p.line) for p in problems] == [
        ("docs/bf16.md", lines.index("Kahan runs 1.23x faster.") + 1),
        ("docs/bf16.md", len(lines)),
    ]
    assert "1.23x" in problems[0].message
    assert all(f in problems[1].message for f in ("+13.9%", "-0.5 pts", "x0.92"))


def test_figures_in_python_docstrings_and_comments_are_reported(repo):
    (repo / "pkg" / "timed.py").write_text(
        '"""Timed module."""\n\n\n'
        "def f() -> str:\n"
        '    """Runs 2.1x faster than the loop (measured)."""\n'
        "    x = 1  # and 0.08x the memory\n"
        "    y = 2  # 3.9x fewer bytes, analytic  # not-a-figure\n"
        '    return f"{x:.2f}x {y}"  # formats, not figures\n'
    )
    problems = [(p.path, p.line, p.kind) for p in _check(repo)]
    assert problems == [("pkg/timed.py", 5, "unrendered figure"), ("pkg/timed.py", 6, "unrendered figure")]


def test_write_selects_blocks_by_the_results_file_they_read(repo, rendered):
    stale = "<!-- ddp:begin -->\nold\n<!-- ddp:end -->"
    for doc in ("docs/zero.md", "README.md"):
        path = repo / doc
        path.write_text(path.read_text().replace(rendered["ddp"], stale) + "\n" + stale + "\n")
    assert write(sources=["zero.json"], root=repo, results_dir=RESULTS_DIR) == []
    assert (repo / "docs" / "zero.md").read_text().count(stale) == 2  # ddp reads ddp.json: left alone
    assert write(sources=["ddp.json"], root=repo, results_dir=RESULTS_DIR) == []
    for doc in ("docs/zero.md", "README.md"):  # a block is rendered wherever it stands
        assert stale not in (repo / doc).read_text()
    assert _check(repo) == []


def test_cli_check_exits_1_on_a_problem(repo, capsys):
    assert figures.main(["--check", "--root", str(repo)]) == 0  # lightning_bigtrain is not in this repository
    (repo / "README.md").write_text((repo / "README.md").read_text() + "\nNow 9.99x faster.\n")
    assert figures.main(["--check", "--root", str(repo)]) == 1
    assert "README.md:" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ (c)
@pytest.mark.skipif(not (ROOT / "docs").exists(), reason="docs/ has not landed yet: README.md still holds the figures")
def test_readme_and_docs_are_the_rendering_of_the_results():
    problems = check()
    assert not problems, "run `python -m benchmarks.figures` (or move typed figures into blocks):\n" + "\n".join(
        map(str, problems)
    )


@pytest.mark.skipif(not (ROOT / "docs").exists(), reason="docs/ has not landed yet")
def test_the_headline_links_cards_that_exist():
    links = re.findall(r"\]\((docs/[\w.-]+\.md)\)", render("headline"))
    assert len(links) >= 8 and all((ROOT / link).exists() for link in links), links
