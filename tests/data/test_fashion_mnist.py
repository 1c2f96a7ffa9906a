"""Fashion-MNIST: IDX parsing, the real files, deterministic disjoint splits, clear missing-data errors."""

from __future__ import annotations

import gzip
import struct

import pytest
import torch

from lightning_bigtrain.data import FashionMNISTDataModule, MissingDataError, load_fashion_mnist
from lightning_bigtrain.data.fashion_mnist import read_idx


def _write_idx(path, tensor: torch.Tensor, code: int, fmt: str) -> None:
    header = struct.pack(">BBBB", 0, 0, code, tensor.ndim) + b"".join(struct.pack(">I", d) for d in tensor.shape)
    body = struct.pack(f">{tensor.numel()}{fmt}", *tensor.reshape(-1).tolist())
    with gzip.open(path, "wb") as f:
        f.write(header + body)


def test_read_idx_round_trips_uint8_and_big_endian_int32(tmp_path):
    u8 = torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8)
    i32 = torch.tensor([[1, -2, 70000], [2**31 - 1, 0, -(2**31)]], dtype=torch.int32)
    _write_idx(tmp_path / "a.gz", u8, 0x08, "B")
    _write_idx(tmp_path / "b.gz", i32, 0x0C, "i")
    assert torch.equal(read_idx(tmp_path / "a.gz"), u8)
    assert torch.equal(read_idx(tmp_path / "b.gz"), i32)


def test_read_idx_rejects_other_files(tmp_path):
    (tmp_path / "x").write_bytes(b"not an idx file")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "x")


def test_real_files_have_the_official_shapes():
    images, labels = load_fashion_mnist("train")
    assert images.shape == (60000, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (60000,) and set(labels.unique().tolist()) == set(range(10))
    test_images, _ = load_fashion_mnist("test")
    assert test_images.shape == (10000, 28, 28)


def test_splits_are_deterministic_and_disjoint():
    a, b = FashionMNISTDataModule(val_size=1000), FashionMNISTDataModule(val_size=1000)
    a.setup(), b.setup()
    assert len(a._splits["train"]) == 59000 and len(a._splits["val"]) == 1000 and len(a._splits["test"]) == 10000
    assert torch.equal(a._splits["val"].images, b._splits["val"].images)
    train = {bytes(img.numpy()) for img in a._splits["train"].images[:5000]}
    assert not any(bytes(img.numpy()) in train for img in a._splits["val"].images)


def test_batches_are_standardised_images(fashion_subset):
    x, y = next(iter(fashion_subset.train_dataloader()))
    assert x.shape == (32, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.long
    assert abs(float(x.mean())) < 0.5 and 0.5 < float(x.std()) < 1.5
    assert len(fashion_subset._splits["train"]) == 1024


def test_missing_data_names_make_data(tmp_path):
    with pytest.raises(MissingDataError, match="make data"):
        FashionMNISTDataModule(data_dir=str(tmp_path))
    with pytest.raises(MissingDataError, match="make data"):
        load_fashion_mnist("train", tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"val_size": 0}, r"val_size=0"), ({"subset": 0}, r"subset=0"), ({"batch_size": -1}, r"batch_size=-1")],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FashionMNISTDataModule(**kwargs)


def test_bad_split_name():
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        load_fashion_mnist("val")  # type: ignore[arg-type]
