"""Fashion-MNIST (Xiao et al., 2017): 70k 28x28 grey-scale images of clothing in 10 classes."""

from __future__ import annotations

import gzip
import os
from typing import Any, Literal

import torch
from torch.utils.data import Dataset

from lightning_bigtrain.data.base import SplitDataModule
from lightning_bigtrain.data.paths import data_root, require
from typing_extensions import override

__all__ = ["CLASSES", "FashionMNISTDataModule", "load_fashion_mnist", "raw_splits", "read_idx", "standardise"]

CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
# Per-pixel statistics of the 60k training images, used to standardise inputs.
MEAN, STD = 0.2860, 0.3530
_IDX_DTYPES = {0x08: torch.uint8, 0x09: torch.int8, 0x0B: torch.int16, 0x0C: torch.int32, 0x0D: torch.float32}


def read_idx(path: str | os.PathLike[str]) -> torch.Tensor:
    """Read one (optionally gzipped) IDX file, the format MNIST-style datasets ship in."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number).")
    ndim = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    dtype = _IDX_DTYPES[raw[2]]
    data = torch.frombuffer(bytearray(raw[4 + 4 * ndim :]), dtype=dtype)
    if dtype != torch.uint8 and dtype != torch.int8:
        data = data.view(torch.uint8).view(-1, data.element_size()).flip(1).reshape(-1).view(dtype)
    return data.reshape(shape)


def load_fashion_mnist(
    split: Literal["train", "test"], data_dir: str | os.PathLike[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (N x 28 x 28, uint8) and labels (N, int64) of one official split."""
    if split not in FILES:
        raise ValueError(f"`load_fashion_mnist(split={split!r})`: split must be 'train' or 'test'.")
    folder = data_root(data_dir) / "fashion-mnist"
    images = read_idx(require(folder / FILES[split][0], "Fashion-MNIST"))
    labels = read_idx(require(folder / FILES[split][1], "Fashion-MNIST")).long()
    return images, labels


def standardise(sample: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(28 x 28 uint8 image, label) -> (standardised 1 x 28 x 28 float image, label): what the model is fed."""
    image, label = sample
    return image.float().div_(255.0).sub_(MEAN).div_(STD).unsqueeze(0), label


class _Raw(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The uint8 images and labels of one split, as stored (what `bigtrain data optimize` writes)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


class _Images(_Raw):
    """Standardised 1 x 28 x 28 float images and their labels, converted per item to keep memory low."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return standardise((self.images[i], self.labels[i]))


def raw_splits(
    data_dir: str | os.PathLike[str] | None, val_size: int, seed: int, subset: int | None
) -> dict[str, _Raw]:
    """The datamodule's train/val/test splits as stored: the official training images split by a seeded
    permutation into train and validation, the official test images as test, each cut to ``subset``."""
    images, labels = load_fashion_mnist("train", data_dir)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    val_idx, train_idx = order[:val_size], order[val_size:]
    test_images, test_labels = load_fashion_mnist("test", data_dir)
    splits = {
        "train": (images[train_idx], labels[train_idx]),
        "val": (images[val_idx], labels[val_idx]),
        "test": (test_images, test_labels),
    }
    if subset is not None:
        splits = {name: (x[:subset], y[:subset]) for name, (x, y) in splits.items()}
    return {name: _Raw(x, y) for name, (x, y) in splits.items()}


class FashionMNISTDataModule(SplitDataModule):
    """Fashion-MNIST as a LightningDataModule.

    Raises :class:`~lightning_bigtrain.data.MissingDataError` at construction when `make data` has not
    set the files up (before any rank is launched, so a 2-rank run cannot hang on a missing file).

    The official 60k training images are split deterministically (seeded permutation) into train and
    validation; the official 10k test images are the test split.

    Args:
        data_dir: The data cache (default: ``$BIGTRAIN_DATA`` or ``./data``), set up by `make data`.
        batch_size: Samples per batch, per process.
        val_size: Training images held out for validation.
        subset: If set, keep only the first ``subset`` samples of every split (for quick tests).
        num_workers: DataLoader worker processes.
        seed: Seed of the train/validation split.
        streaming: Read the splits as shards from this URL (``s3://bucket/fmnist``, a local path, any fsspec
            URL) instead of the local files, written there with the same ``val_size``, ``seed`` and ``subset`` by
            ``bigtrain data optimize fashion-mnist URL``.
        cache_dir: Where streamed shards are cached (see :class:`~lightning_bigtrain.data.StreamingDataset`).
    """

    source_name = "fashion-mnist"

    def __init__(
        self,
        data_dir: str | None = None,
        batch_size: int = 64,
        val_size: int = 5000,
        subset: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        streaming: str | None = None,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"`FashionMNISTDataModule(batch_size={batch_size})`: batch_size must be >= 1.")
        if not 0 < val_size < 60000:
            raise ValueError(f"`FashionMNISTDataModule(val_size={val_size})`: val_size must be between 1 and 59999.")
        if subset is not None and subset < 1:
            raise ValueError(f"`FashionMNISTDataModule(subset={subset})`: subset must be >= 1 or None.")
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.batch_size = batch_size
        self.val_size = val_size
        self.subset = subset
        self.num_workers = num_workers
        self.seed = seed
        self.streaming = streaming
        self.cache_dir = cache_dir
        self.num_classes = len(CLASSES)
        self.prepare_data()  # offline data only: fail here, before any process is launched

    @override
    def prepare_data(self) -> None:
        if self.streaming is not None:
            self._check_streaming(self.stored_as())
            return
        folder = data_root(self.data_dir) / "fashion-mnist"
        for name in (*FILES["train"], *FILES["test"]):
            require(folder / name, "Fashion-MNIST")

    @override
    def setup(self, stage: str | None = None) -> None:
        if self._splits:
            return
        if self.streaming is not None:
            self._streaming_splits(standardise)
            return
        for name, raw in raw_splits(self.data_dir, self.val_size, self.seed, self.subset).items():
            self._splits[name] = _Images(raw.images, raw.labels)

    def stored_as(self) -> dict[str, Any]:
        """What the shards of this datamodule's splits record (``bigtrain data optimize`` writes it)."""
        return {"source": self.source_name, "val_size": self.val_size, "seed": self.seed, "subset": self.subset}
