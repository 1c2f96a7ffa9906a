"""A tiny regression LightningModule for fits run in the test process: a 4 -> 1 linear layer, 6 shuffled training
batches of 4 and 2 fixed validation batches, seeded."""

from __future__ import annotations

import lightning as L
import torch


class TinyRegression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return (self.layer(batch[0]) - batch[1]).pow(2).mean()

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def _data(self, n: int, seed: int) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(seed)
        data = torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=4, shuffle=seed == 0)

    def train_dataloader(self):
        return self._data(24, 0)  # 6 batches

    def val_dataloader(self):
        return self._data(8, 1)
