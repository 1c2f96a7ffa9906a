"""What the bundled datamodules share: train/val/test splits held in memory or streamed from shards, served by
DataLoaders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

__all__ = ["SplitDataModule"]

SPLITS = ("train", "val", "test")


class SplitDataModule(L.LightningDataModule):
    """A datamodule whose ``setup`` fills ``self._splits`` with ``"train"``, ``"val"`` and ``"test"``
    datasets; subclasses set ``batch_size`` and ``num_workers``.

    With ``streaming`` set (a URL written by ``bigtrain data optimize``), the splits are
    :class:`~lightning_bigtrain.data.StreamingDataset` s of ``<streaming>/train`` etc., served in
    :class:`~lightning_bigtrain.data.StreamingSampler`'s order.
    """

    batch_size: int
    num_workers: int
    streaming: str | None = None
    cache_dir: str | None = None
    source_name: str = ""  # what `bigtrain data optimize` calls this dataset

    def __init__(self) -> None:
        super().__init__()
        self._splits: dict[str, Dataset[Any]] = {}

    @override
    def setup(self, stage: str | None = None) -> None:  # filled in by subclasses
        raise NotImplementedError

    def _check_streaming(self, expect: dict[str, Any]) -> None:
        """Fail at construction when ``streaming`` names no dataset written for this datamodule's settings."""
        from lightning_bigtrain.data.streaming import INDEX_FILE, read_index

        assert self.streaming is not None
        url = f"{self.streaming.rstrip('/')}/train"
        try:
            meta = read_index(url).get("meta", {})
        except FileNotFoundError:
            raise FileNotFoundError(
                f"`{type(self).__name__}(streaming={self.streaming!r})`: no dataset at {url} ({INDEX_FILE} is "
                f"missing). Write it with `bigtrain data optimize {self.source_name} {self.streaming}`."
            ) from None
        for key, value in expect.items():
            if meta.get(key) != value:
                raise ValueError(
                    f"`{type(self).__name__}(streaming={self.streaming!r})`: the shards were written with {key}="
                    f"{meta.get(key)!r}, this datamodule asks for {key}={value!r}. Write them again with "
                    f"`bigtrain data optimize {self.source_name} {self.streaming} --overwrite` and the same settings."
                )

    def _streaming_splits(self, transform: Callable[[Any], Any]) -> None:
        from lightning_bigtrain.data.streaming import StreamingDataset

        assert self.streaming is not None
        for name in SPLITS:
            url = f"{self.streaming.rstrip('/')}/{name}"
            self._splits[name] = StreamingDataset(url, transform=transform, cache_dir=self.cache_dir)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        dataset = self._splits[split]
        if self.streaming is not None:
            from lightning_bigtrain.data.streaming import StreamingDataset, streaming_loader

            assert isinstance(dataset, StreamingDataset)
            return streaming_loader(dataset, self.batch_size, shuffle=shuffle, num_workers=self.num_workers)
        return DataLoader(
            dataset,
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
