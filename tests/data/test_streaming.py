"""Streaming datasets: the shard format, the shard-wise order, the cache, S3 through a real server, resume."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_bigtrain.data.resumable import make_resumable
from lightning_bigtrain.data.streaming import (
    StreamingDataset,
    StreamingSampler,
    shard_order,
    streaming_loader,
    write_shards,
)


def _samples(n: int) -> list:
    return [(torch.full((2, 3), i, dtype=torch.int16), i, float(i) / 2) for i in range(n)]


def test_samples_read_back_as_written_column_wise_and_row_wise(tmp_path):
    data = _samples(37)
    index = write_shards(data, str(tmp_path / "cols"), shard_bytes=64)
    assert len(index["shards"]) > 3 and index["num_samples"] == 37
    ds = StreamingDataset(str(tmp_path / "cols"))
    assert len(ds) == 37
    for i in (0, 5, 36, -1):
        x, label, half = ds[i]
        assert torch.equal(x, data[i][0]) and x.dtype == torch.int16
        assert label == data[i][1] and type(label) is int and half == data[i][2] and type(half) is float
    with pytest.raises(IndexError, match="out of range"):
        ds[37]
    ragged = [{"ids": torch.arange(i + 1), "arr": np.ones(2, dtype=np.float32)} for i in range(5)]  # row-wise
    write_shards(ragged, str(tmp_path / "rows"))
    back = StreamingDataset(str(tmp_path / "rows"))
    assert torch.equal(back[3]["ids"], torch.arange(4)) and torch.equal(back[3]["arr"], torch.ones(2))


def test_bad_input_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(TypeError, match="a sample holds a str"):
        write_shards([("text", 1)], str(tmp_path / "a"))
    with pytest.raises(ValueError, match="empty"):
        write_shards([], str(tmp_path / "b"))
    with pytest.raises(ValueError, match="shard_bytes='lots'"):
        write_shards(_samples(2), str(tmp_path / "c"), shard_bytes="lots")
    with pytest.raises(ValueError, match="shard_bytes=0.*at least one byte"):
        write_shards(_samples(2), str(tmp_path / "c"), shard_bytes=0)
    with pytest.raises(FileNotFoundError, match="bigtrain data optimize"):
        StreamingDataset(str(tmp_path / "nothing"))
    write_shards(_samples(4), str(tmp_path / "d"))
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_shards(_samples(4), str(tmp_path / "d"))
    with pytest.raises(ValueError, match="shuffle_window=0"):
        StreamingDataset(str(tmp_path / "d"), shuffle_window=0)


def test_overwrite_commits_the_new_index_then_deletes_the_old_shards(tmp_path):
    url = str(tmp_path / "ds")
    write_shards(_samples(10), url, shard_bytes=64)
    old = {p.name for p in (tmp_path / "ds").glob("*.pt")}
    write_shards(_samples(6), url, shard_bytes=64, overwrite=True, meta={"v": 2})
    ds = StreamingDataset(url)
    assert len(ds) == 6 and ds.meta == {"v": 2}
    assert not old & {p.name for p in (tmp_path / "ds").glob("*.pt")}


def test_a_damaged_shard_is_named(tmp_path):
    url = str(tmp_path / "ds")
    index = write_shards(_samples(10), url, shard_bytes=64)
    name = index["shards"][1]["name"]
    raw = bytearray((tmp_path / "ds" / name).read_bytes())
    raw[-10] ^= 0xFF
    (tmp_path / "ds" / name).write_bytes(bytes(raw))
    ds = StreamingDataset(url)
    ds[0]
    with pytest.raises(OSError, match=f"shard {name} .* is damaged"):
        ds[ds.shard_sizes[0]]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("seed", [None, 0, 5])
def test_the_order_holds_every_sample_once_and_keeps_shards_on_one_rank(world, seed):
    sizes = [7, 7, 7, 7, 7, 7, 7, 3, 7, 7, 5]
    order = shard_order(sizes, world, seed, shuffle_window=2)
    assert sorted(order) == list(range(sum(sizes)))
    assert order == shard_order(sizes, world, seed, shuffle_window=2)  # every rank computes the same list
    starts = np.cumsum([0, *sizes])
    owners: dict[int, set[int]] = {}
    lengths = []
    for r in range(world):
        stream = order[r::world]
        lengths.append(len(stream))
        for i in stream:
            owners.setdefault(int(np.searchsorted(starts, i, side="right") - 1), set()).add(r)
    assert max(lengths) - min(lengths) <= 1
    split = sum(len(o) > 1 for o in owners.values())
    assert split <= world - 1  # only the samples evening out the streams leave their shard's rank
    if seed is not None:
        assert order != shard_order(sizes, world, seed + 1, shuffle_window=2)
        assert order[::world] != sorted(order[::world])


def _sampler_ranks(ds, world: int, seed: int = 3) -> list[StreamingSampler]:
    return [StreamingSampler(ds, num_replicas=world, rank=r, seed=seed) for r in range(world)]


def test_resume_2_1_2_within_an_epoch_sees_every_sample_once(tmp_path):
    write_shards(_samples(51), str(tmp_path / "ds"), shard_bytes=100)
    ds = StreamingDataset(str(tmp_path / "ds"))
    batch, epoch = 4, 2
    first = _sampler_ranks(ds, 2)
    for s in first:
        s.set_epoch(epoch)
    seen = [i for s in first for i in list(s)[: 3 * batch]]
    cursor = first[0].cursor(3 * batch)
    (single,) = _sampler_ranks(ds, 1)
    single.order_world_size = first[0].list_world_size()  # what the checkpoint carries
    single.resume(epoch, cursor, counted=3 * batch)
    seen += list(single)[: 3 * batch]
    cursor = single.cursor(6 * batch)
    last = _sampler_ranks(ds, 2)
    for s in last:
        s.order_world_size = single.list_world_size()
        s.resume(epoch, cursor, counted=6 * batch)
    seen += [i for s in last for i in s]
    counts = Counter(seen)
    assert set(counts) == set(range(51))
    assert sum(counts.values()) - 51 == (51 - 36) % 2  # the last partition's padding only
    for s in last:  # the next epoch is dealt out by shards to this world size again
        s.set_epoch(epoch + 1)
        assert s.list_world_size() == 2


def _trainer(processed: int) -> SimpleNamespace:
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress),
                                                    _combined_loader=None), limit_train_batches=1.0)  # fmt: skip


def test_lightnings_sampler_over_a_streaming_dataset_becomes_a_resumable_streaming_sampler(tmp_path):
    write_shards(_samples(40), str(tmp_path / "ds"), shard_bytes=100)
    ds = StreamingDataset(str(tmp_path / "ds"))
    trainer = _trainer(0)
    made = [make_resumable(DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=2, rank=r, seed=9)),
                           lambda: trainer) for r in range(2)]  # fmt: skip
    assert all(isinstance(m.sampler, StreamingSampler) and m.sampler.seed == 9 for m in made)
    full = [[int(y) for _, ys, _ in m for y in ys] for m in made]
    assert sorted(full[0] + full[1]) == list(range(40))
    trainer.fit_loop.epoch_loop.batch_progress.current.processed = 3
    state = made[1].state_dict()
    assert state["cursor"] == 24 and state["order_world_size"] == 2
    unshuffled = make_resumable(DataLoader(ds, batch_size=4), lambda: _trainer(3))
    with pytest.raises(ValueError, match="for a shuffled loader; this run's is unshuffled"):
        unshuffled.load_state_dict(state)
    one = make_resumable(DataLoader(ds, batch_size=4, shuffle=True), lambda: _trainer(3))  # one process, 2 -> 1
    with pytest.warns(UserWarning, match=r"global batch of 4 samples \(1 x 4\) from a checkpoint taken at 8"):
        one.load_state_dict(state)  # (it takes the checkpoint's seed)
    rest = [int(y) for _, ys, _ in one for y in ys]
    assert sorted(full[0][:12] + full[1][:12] + rest) == list(range(40))
    own = make_resumable(streaming_loader(ds, batch_size=4, seed=9), lambda: trainer)  # the user's own sampler
    assert own.sampler.seed == 9 and callable(own.state_dict)


def test_a_position_of_another_kind_of_order_is_refused(tmp_path):
    """A map-style loader's position (a cursor into a permutation of samples) means nothing in a streaming order."""
    write_shards(_samples(40), str(tmp_path / "ds"), shard_bytes=100)
    ds = StreamingDataset(str(tmp_path / "ds"))
    plain = make_resumable(DataLoader(list(range(40)), batch_size=4, shuffle=True), lambda: _trainer(2))
    state = plain.state_dict()
    assert state["order"] == "samples"
    streamed = make_resumable(DataLoader(ds, batch_size=4, shuffle=True), lambda: _trainer(2))
    state["seed"] = streamed.sampler.seed
    with pytest.raises(ValueError, match="counts samples .* this run's loader counts shards"):
        streamed.load_state_dict(state)


def test_a_random_order_warns_that_it_reloads_shards(tmp_path):
    write_shards(_samples(2000), str(tmp_path / "ds"), shard_bytes=1400)  # 50 samples a shard
    ds = StreamingDataset(str(tmp_path / "ds"), shuffle_window=1)
    for i in StreamingSampler(ds, seed=0):  # the streaming order loads each shard once
        ds[i]
    assert ds.loads == len(ds.shard_sizes)
    with pytest.warns(UserWarning, match="streaming_loader"):
        for i in torch.randperm(2000, generator=torch.Generator().manual_seed(0)).tolist()[:100]:
            ds[i]


def test_s3_through_a_real_server_two_workers_and_a_bounded_cache(s3_bucket, tmp_path):
    fs, bucket = s3_bucket
    data = _samples(300)
    index = write_shards(data, f"s3://{bucket}/ds", shard_bytes=400)
    sizes = [s["bytes"] for s in index["shards"]]
    assert fs.exists(f"{bucket}/ds/index.json") and len(sizes) > 10
    with pytest.raises(ValueError, match="cache_limit"):
        StreamingDataset(f"s3://{bucket}/ds", cache_dir=tmp_path / "c", cache_limit=max(sizes))
    limit = 6 * max(sizes)
    ds = StreamingDataset(f"s3://{bucket}/ds", cache_dir=tmp_path / "cache", cache_limit=limit, shuffle_window=2)
    # Workers from a forkserver (a fresh interpreter), not forked from this pytest worker: in a full-suite run it
    # carries earlier tests' threads (Ray's, gloo's, fsspec's, moto's), and once (CI, 2026-12-07) a forked worker
    # never delivered a batch (a 900 s hang, not reproduced alone or after those tests). A stuck worker now fails
    # the test in two minutes.
    loader = streaming_loader(ds, batch_size=16, seed=1, num_workers=2, multiprocessing_context="forkserver", timeout=120)
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        labels = [int(y) for _, ys, _ in loader for y in ys]
        assert sorted(labels) == list(range(300))
        cached = sum(p.stat().st_size for p in (tmp_path / "cache").rglob("*.pt"))
        assert 0 < cached <= limit
    assert not list((tmp_path / "cache").rglob("*.part"))
    x, label, _ = ds[123]  # the main process reads through the same cache
    assert torch.equal(x, data[123][0]) and label == 123
    cached = sorted((tmp_path / "cache").rglob("*.pt"))
    cached[0].write_bytes(b"\0" * cached[0].stat().st_size)  # a damaged copy of the right size: fetched again
    again = StreamingDataset(f"s3://{bucket}/ds", cache_dir=tmp_path / "cache", cache_limit=limit, shuffle_window=2)
    assert sorted(int(y) for _, y, _ in again.__getitems__(list(range(300)))) == list(range(300))
    # A damaged remote shard is refused, not cached.
    name = index["shards"][-1]["name"]
    fs.pipe(f"{bucket}/ds/{name}", b"not a shard")
    fresh = StreamingDataset(f"s3://{bucket}/ds", cache_dir=tmp_path / "other", cache_limit=limit)
    with pytest.raises(OSError, match="damaged"):
        fresh[299]
    assert not list((tmp_path / "other").rglob("*.pt"))  # the shards read before it are; the damaged one is not
    assert json.loads(fs.cat(f"{bucket}/ds/index.json"))["num_samples"] == 300


def test_a_shared_cache_never_serves_another_datasets_or_an_older_versions_shard(s3_bucket, tmp_path):
    """Two datasets with the same shard names in one cache folder, and a dataset written again at its URL (same
    names and sizes, other values): each read returns what its index says."""
    fs, bucket = s3_bucket
    a = [(torch.full((4,), i, dtype=torch.int32),) for i in range(8)]
    b = [(torch.full((4,), 100 + i, dtype=torch.int32),) for i in range(8)]
    write_shards(a, f"s3://{bucket}/a", shard_bytes=16)
    write_shards(b, f"s3://{bucket}/b", shard_bytes=16)  # the same shard names and sizes as a's
    cache = tmp_path / "shared"
    assert int(StreamingDataset(f"s3://{bucket}/a", cache_dir=cache)[3][0][0]) == 3
    assert int(StreamingDataset(f"s3://{bucket}/b", cache_dir=cache)[3][0][0]) == 103
    fs.rm(f"{bucket}/a", recursive=True)
    write_shards(b, f"s3://{bucket}/a", shard_bytes=16)  # a written again: b's values under a's old names
    assert int(StreamingDataset(f"s3://{bucket}/a", cache_dir=cache)[3][0][0]) == 103


def test_the_bundled_datamodules_stream_what_optimize_wrote(tmp_path, capsys):
    """`bigtrain data optimize` writes the datamodule's splits as stored; `streaming=` reads back exactly the
    samples of the local files; other settings than the shards were written with are refused."""
    from lightning_bigtrain.cli import main
    from lightning_bigtrain.data import FashionMNISTDataModule, ShakespeareDataModule

    with pytest.raises(FileNotFoundError, match="bigtrain data optimize fashion-mnist"):
        FashionMNISTDataModule(streaming=str(tmp_path / "fm"))
    for src, extra in (("fashion-mnist", ["--subset", "300"]), ("shakespeare", ["--subset", "40", "--block-size", "16"])):
        with pytest.raises(SystemExit) as done:
            main(["data", "optimize", src, str(tmp_path / src), "--shard-bytes", "4KiB", *extra])
        assert done.value.code == 0
    assert "train: 300 samples" in capsys.readouterr().out
    pairs = [
        (FashionMNISTDataModule(subset=300, batch_size=8), FashionMNISTDataModule(subset=300, batch_size=8,
                                                                                 streaming=str(tmp_path / "fashion-mnist"))),
        (ShakespeareDataModule(subset=40, block_size=16), ShakespeareDataModule(subset=40, block_size=16,
                                                                               streaming=str(tmp_path / "shakespeare"))),
    ]  # fmt: skip
    for local, streamed in pairs:
        local.setup()
        streamed.setup()
        for split in ("train", "val", "test"):
            a, b = local._splits[split], streamed._splits[split]
            assert len(a) == len(b)
            for i in (0, len(a) // 2, len(a) - 1):
                assert all(torch.equal(x, y) for x, y in zip(a[i], b[i], strict=True))
        loader = streamed.train_dataloader()
        assert isinstance(loader.sampler, StreamingSampler) and len(list(loader.sampler)) == len(streamed._splits["train"])
    with pytest.raises(ValueError, match="written with block_size=16, this datamodule asks for block_size=32"):
        ShakespeareDataModule(subset=40, block_size=32, streaming=str(tmp_path / "shakespeare"))
    with pytest.raises(SystemExit):
        main(["data", "optimize", "fashion-mnist", str(tmp_path / "fashion-mnist"), "--subset", "300"])  # exists
    assert "overwrite" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["data", "optimize", "fashion", str(tmp_path / "x")])
    assert "give one of fashion-mnist, shakespeare or `package.module:name`" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["data", "optimize", "lightning_bigtrain.data.fashion_mnist:CLASSES", str(tmp_path / "y")])
    assert "a sample holds a str" in capsys.readouterr().err
