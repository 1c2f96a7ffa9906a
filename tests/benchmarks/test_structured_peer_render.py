"""The README's structured-pruning comparison is the rendering of benchmarks/results/structured_peer.json."""

from __future__ import annotations

import json

import pytest

from benchmarks.common import RESULTS_DIR
from benchmarks.structured_peer import _BEGIN, _END, README, render


def test_readme_table_is_rendered_from_the_results_file():
    path = RESULTS_DIR / "structured_peer.json"
    if not path.exists():
        pytest.fail("benchmarks/results/structured_peer.json is missing: run `python -m benchmarks.structured_peer`")
    text = README.read_text()
    assert text[text.index(_BEGIN) : text.index(_END) + len(_END)] == render(json.loads(path.read_text()))
