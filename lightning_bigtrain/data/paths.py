"""Where the bundled real datasets live once `make data` has set them up."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["MissingDataError", "data_root", "require"]

_REPO_ROOT = Path(__file__).resolve().parents[2]


class MissingDataError(FileNotFoundError):
    """A dataset file is not on disk; the message says how to set it up."""


def data_root(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The data cache directory.

    Resolution order: the explicit ``data_dir``; ``$BIGTRAIN_DATA``; ``./data`` when it exists;
    the ``data/`` folder of a source checkout (so notebooks run from ``notebooks/`` find it).
    """
    if data_dir is not None:
        return Path(data_dir).expanduser()
    env = os.environ.get("BIGTRAIN_DATA")
    if env:
        return Path(env).expanduser()
    local = Path("data")
    if local.is_dir():
        return local
    return _REPO_ROOT / "data"


def require(path: Path, dataset: str) -> Path:
    """Return ``path`` if it exists, else raise :class:`MissingDataError` naming `make data`."""
    if not path.exists():
        raise MissingDataError(
            f"{dataset} is not set up: {path} does not exist. Run `make data` in the lightning_bigtrain "
            "checkout (or `python -m lightning_bigtrain.data.prepare "
            f"{dataset.lower().replace(' ', '-')} --root DIR`), "
            "and point `data_dir=` or $BIGTRAIN_DATA at that directory."
        )
    return path
