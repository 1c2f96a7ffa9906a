"""FashionCNN: shapes, bad input, and learning on real Fashion-MNIST."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_bigtrain.models import FashionCNN


def test_logits_shape():
    assert FashionCNN(channels=(4, 8, 8))(torch.randn(3, 1, 28, 28)).shape == (3, 10)


def test_bad_channels():
    with pytest.raises(ValueError, match="positive channel counts"):
        FashionCNN(channels=(8, 0))


def test_learns_real_images(fashion_subset):
    L.seed_everything(0, verbose=False)
    model = FashionCNN(channels=(8, 16, 32))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, datamodule=fashion_subset)
    trainer.test(model, datamodule=fashion_subset, verbose=False)
    assert float(trainer.callback_metrics["test_acc"]) > 0.6  # chance is 0.1
