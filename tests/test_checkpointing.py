"""Atomic checkpoints: commit last, previous kept through a failed save, damaged ones skipped, remote pointers."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_bigtrain import checkpointing
from lightning_bigtrain.checkpointing import (
    COMMIT_MARKER,
    AtomicCheckpointIO,
    CheckpointDamagedWarning,
    atomic_folder_save,
    is_committed,
    latest_checkpoint,
    load_path,
    remove_checkpoint,
)


class _Killed(Exception):
    """Stands for the process dying at a fault point (the chaos tests kill real jobs)."""


@pytest.fixture
def fault_at():
    def arm(point: str) -> None:
        def hook(p: str) -> None:
            if p == point:
                raise _Killed(p)

        checkpointing.fault_hook = hook

    yield arm
    checkpointing.fault_hook = None


def _write_folder(value: float):
    def write(staging: str) -> None:
        os.makedirs(staging)
        torch.save({"w": torch.full((64,), value)}, os.path.join(staging, "shard0.pt"))
        torch.save({"step": int(value)}, os.path.join(staging, "meta.pt"))

    return write


def _read_folder(path: str) -> float:
    return float(torch.load(os.path.join(path, "shard0.pt"))["w"][0])


def test_file_checkpoint_replaced_atomically_and_a_killed_save_keeps_the_previous(tmp_path, fault_at):
    io = AtomicCheckpointIO()
    path = str(tmp_path / "last.ckpt")
    io.save_checkpoint({"step": 1}, path)
    io.save_checkpoint({"step": 2}, path)
    assert io.load_checkpoint(path)["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]
    fault_at("save_before_commit")
    with pytest.raises(_Killed):
        io.save_checkpoint({"step": 3}, path)
    checkpointing.fault_hook = None
    assert io.load_checkpoint(path)["step"] == 2  # the partial file is not what `last` names
    assert any(".partial-" in n for n in os.listdir(tmp_path))
    io.save_checkpoint({"step": 4}, path)  # the next save clears what the killed one left
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt"]


def test_folder_checkpoint_is_committed_with_a_manifest_and_named_by_a_link(tmp_path, fault_at):
    strategy = SingleDeviceStrategy("cpu")
    path = str(tmp_path / "last.ckpt")
    atomic_folder_save(strategy, path, _write_folder(1.0))
    first = os.readlink(path)
    assert is_committed(path) and os.path.exists(tmp_path / first / COMMIT_MARKER)
    atomic_folder_save(strategy, path, _write_folder(2.0))
    assert _read_folder(load_path(path)) == 2.0
    assert not os.path.exists(tmp_path / first), "the previous data is deleted once the new one is committed"
    for point in ("save_before_commit", "save_after_commit"):
        fault_at(point)
        with pytest.raises(_Killed):
            atomic_folder_save(strategy, path, _write_folder(3.0))
        checkpointing.fault_hook = None
        expected = 2.0 if point == "save_before_commit" else 3.0
        assert is_committed(path) and _read_folder(load_path(path)) == expected
    remove_checkpoint(path)
    assert os.listdir(tmp_path) == [] or all(".data-" not in n for n in os.listdir(tmp_path))


def test_damaged_checkpoint_is_skipped_for_the_newest_committed_one(tmp_path):
    strategy = SingleDeviceStrategy("cpu")
    older, newer = str(tmp_path / "epoch=0-step=2.ckpt"), str(tmp_path / "last.ckpt")
    atomic_folder_save(strategy, older, _write_folder(2.0))
    atomic_folder_save(strategy, newer, _write_folder(4.0))
    assert latest_checkpoint(tmp_path) == newer
    shard = os.path.join(load_path(newer), "shard0.pt")
    with open(shard, "r+b") as f:
        f.truncate(10)
    assert not is_committed(newer)
    with pytest.warns(CheckpointDamagedWarning, match=r"last\.ckpt' is skipped: shard0\.pt has 10 bytes"):
        assert _read_folder(load_path(newer)) == 2.0
    assert latest_checkpoint(tmp_path) == older
    remove_checkpoint(older)
    with pytest.raises(FileNotFoundError, match=r"holds no other committed checkpoint"):
        load_path(newer)


def test_partial_folder_without_marker_is_not_committed(tmp_path):
    partial = tmp_path / "x.ckpt.data-abc"
    _write_folder(1.0)(str(partial))
    os.symlink(partial.name, tmp_path / "x.ckpt")
    assert not is_committed(str(tmp_path / "x.ckpt"))
    assert latest_checkpoint(tmp_path) is None


def test_folder_checkpoint_on_s3_is_named_by_a_pointer_object(s3_bucket):
    fs, bucket = s3_bucket
    strategy = SingleDeviceStrategy("cpu")
    path = f"s3://{bucket}/run/last.ckpt"

    def write(value: float):
        def _write(staging: str) -> None:
            with fs.open(f"{staging}/shard0.pt", "wb") as f:
                torch.save({"w": torch.full((8,), value)}, f)

        return _write

    atomic_folder_save(strategy, path, write(1.0))
    atomic_folder_save(strategy, path, write(2.0))
    target = load_path(path)
    assert ".data-" in target and fs.isfile(path)
    with fs.open(f"{target}/shard0.pt", "rb") as f:
        assert float(torch.load(f)["w"][0]) == 2.0
    data = [p for p in fs.ls(f"{bucket}/run") if ".data-" in p]
    assert len(data) == 1, "the previous data folder is deleted after the pointer names the new one"
    assert latest_checkpoint(f"s3://{bucket}/run") == path
