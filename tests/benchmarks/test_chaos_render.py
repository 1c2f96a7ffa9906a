"""The README's crash-consistency figures are the rendering of benchmarks/results/chaos.json (they cannot drift)."""

from __future__ import annotations

import json

import pytest

from benchmarks.chaos import _BEGIN, _END, README, render
from benchmarks.common import RESULTS_DIR


def test_readme_figures_are_rendered_from_the_results_file():
    path = RESULTS_DIR / "chaos.json"
    if not path.exists():
        pytest.fail("benchmarks/results/chaos.json is missing: run `python -m benchmarks.chaos`")
    text = README.read_text()
    block = text[text.index(_BEGIN) : text.index(_END) + len(_END)]
    assert block == render(json.loads(path.read_text()))
