"""A callback that slows each optimizer step, so that a test can stop a tune driver while its trial runs."""

from __future__ import annotations

import time
from typing import Any

import lightning as L

__all__ = ["SlowSteps"]


class SlowSteps(L.Callback):
    """Sleep ``seconds`` after every training batch."""

    def __init__(self, seconds: float = 0.1) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        time.sleep(self.seconds)
