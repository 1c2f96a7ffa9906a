"""Helpers for the tune tests: a callback that slows each optimizer step (so that a test can stop a tune driver while
its trial runs), and a Hugging Face-style language-model LightningModule."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

__all__ = ["CausalLM", "SlowSteps"]


class SlowSteps(L.Callback):
    """Sleep ``seconds`` after every training batch."""

    def __init__(self, seconds: float = 0.1) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        time.sleep(self.seconds)


class CausalLM(L.LightningModule):
    """How a Hugging Face user writes a language model's LightningModule: the model (``GPT2LMHeadModel`` built from
    its config, say) passed in, ``self.model(input_ids=x, labels=x).loss``, AdamW. Used by tune tests on a model this
    project did not write."""

    def __init__(self, model: torch.nn.Module, lr: float = 3e-3) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch[0], labels=batch[0]).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)
