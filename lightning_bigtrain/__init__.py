"""lightning_bigtrain: large-model training techniques for any LightningModule.

Everything is reached through ``Trainer`` arguments (``strategy=``, ``callbacks=``, ``plugins=``)
from Python, a notebook, or the ``bigtrain`` CLI. Subpackages load on first attribute access so that
``import lightning_bigtrain`` stays fast; heavy optional engines (DeepSpeed) load only where used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_SUBMODULES = ("callbacks", "cli", "data", "functional", "models", "warnings")

__all__ = ["__version__", "callbacks", "cli", "data", "functional", "models", "warnings"]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from lightning_bigtrain import callbacks, cli, data, functional, models, warnings


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        module = importlib.import_module(f"{__name__}.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'lightning_bigtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
