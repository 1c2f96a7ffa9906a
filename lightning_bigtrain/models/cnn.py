"""A small convolutional classifier for Fashion-MNIST: an ordinary LightningModule."""

from __future__ import annotations

from collections.abc import Sequence

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

__all__ = ["FashionCNN"]


class FashionCNN(L.LightningModule):
    """Conv-BN-ReLU stages with max-pooling, global average pooling and a linear classifier.

    Knows nothing of lightning_bigtrain: it stands for "any LightningModule" in tests and demos.

    Args:
        channels: Output channels of each conv stage; each stage after the first halves the resolution.
        num_classes: Classes to predict.
        in_channels: Input image channels (1 for Fashion-MNIST).
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay on conv and linear weights.
    """

    def __init__(
        self,
        channels: Sequence[int] = (32, 64, 128),
        num_classes: int = 10,
        in_channels: int = 1,
        lr: float = 1e-2,
        weight_decay: float = 5e-4,
    ) -> None:
        super().__init__()
        if not channels or any(c < 1 for c in channels):
            raise ValueError(f"`FashionCNN(channels={channels})`: give one or more positive channel counts.")
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = in_channels
        for i, c in enumerate(channels):
            if i > 0:
                layers.append(nn.MaxPool2d(2))
            layers += [nn.Conv2d(width, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True)]
            width = c
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)
        self.lr, self.weight_decay = lr, weight_decay
        self.val_acc = MulticlassAccuracy(num_classes)
        self.test_acc = MulticlassAccuracy(num_classes)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits (batch x num_classes) of images (batch x channels x height x width)."""
        return self.classifier(self.features(x).mean(dim=(2, 3)))

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    @override
    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_acc(logits, y)
        self.log("test_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("test_acc", self.test_acc)

    @override
    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        decay = [p for n, p in self.named_parameters() if p.ndim > 1]
        no_decay = [p for n, p in self.named_parameters() if p.ndim <= 1]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.lr,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
