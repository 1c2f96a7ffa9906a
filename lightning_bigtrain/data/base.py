"""What the bundled datamodules share: train/val/test splits held in memory, served by DataLoaders."""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

__all__ = ["SplitDataModule"]


class SplitDataModule(L.LightningDataModule):
    """A datamodule whose ``setup`` fills ``self._splits`` with ``"train"``, ``"val"`` and ``"test"``
    datasets; subclasses set ``batch_size`` and ``num_workers``."""

    batch_size: int
    num_workers: int

    def __init__(self) -> None:
        super().__init__()
        self._splits: dict[str, Dataset[Any]] = {}

    @override
    def setup(self, stage: str | None = None) -> None:  # filled in by subclasses
        raise NotImplementedError

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        return DataLoader(
            self._splits[split],
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)
