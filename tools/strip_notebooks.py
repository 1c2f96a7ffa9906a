"""Strip outputs and execution counts from notebooks (pre-commit hook): notebooks are committed clean."""

from __future__ import annotations

import sys

import nbformat


def strip(path: str) -> bool:
    """Strip ``path`` in place; True if it changed."""
    nb = nbformat.read(path, as_version=4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            cell.outputs, cell.execution_count = [], None
            changed = True
    if changed:
        nbformat.write(nb, path)
    return changed


if __name__ == "__main__":
    changed = [p for p in sys.argv[1:] if strip(p)]
    for p in changed:
        print(f"stripped outputs from {p}")
    sys.exit(1 if changed else 0)
