"""lightning_bigtrain: large-model training techniques for any LightningModule.

Everything is reached through ``Trainer`` arguments (``strategy=``, ``callbacks=``, ``plugins=``)
from Python, a notebook, or the ``bigtrain`` CLI. Importing the package registers its strategy names
(``"bigtrain_zero3"``, ...) with Lightning; heavy optional engines (DeepSpeed) load only where used.
"""

from __future__ import annotations

__version__ = "0.1.0"

from lightning_bigtrain import (
    callbacks,
    compression,
    data,
    functional,
    models,
    planning,
    plugins,
    strategies,
    utilities,
    warnings,
)

__all__ = [
    "__version__",
    "callbacks",
    "compression",
    "data",
    "functional",
    "models",
    "planning",
    "plugins",
    "strategies",
    "utilities",
    "warnings",
]
