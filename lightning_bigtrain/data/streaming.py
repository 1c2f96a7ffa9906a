"""Sharded datasets streamed from any fsspec URL (``s3://``, ``gs://``, ``hdfs://``, local paths), resumable mid-epoch.

A dataset is written once as **shards** (:func:`write_shards`, or ``bigtrain data optimize SRC DST``): files of
a few tens of MiB each, ``shard-00000.pt`` ..., holding whole samples, and an ``index.json`` naming every shard
with its sample count, size and SHA-256. The index is written last: it is the commit, so a reader never sees a
half-written dataset. Samples are tensors, Python numbers, or tuples/lists/dicts of them; a shard whose samples
all have the same structure and per-field shape is stored column-wise (one stacked tensor per field), otherwise
as a list. Shards are read with ``torch.load(weights_only=True)``: no code in a shard is ever run.

:class:`StreamingDataset` is a map-style dataset over such an index. Remote shards are downloaded whole into a
local cache (checked against the index's size and hash, renamed into place when complete, one download per
shard per machine under a file lock shared by ranks and loader workers), decoded shards are kept in memory a
few at a time, and the cache is held under ``cache_limit`` by deleting the least recently used shards.

Random access over a shuffled index list would load a shard for every few samples, so the order is the
sampler's job: :class:`StreamingSampler` shuffles the **shards** (seeded by ``seed + epoch``), deals them out to
the ranks balanced by sample count, shuffles samples within windows of ``shuffle_window`` shards, and
interleaves the ranks' streams into one global list in which ``list[rank::world_size]`` is rank ``rank``'s own
stream. Because it is a :class:`~lightning_bigtrain.data.resumable.ResumableDistributedSampler`, the position in
the epoch is the same global cursor as for every other loader of this package: saved in checkpoints, restored
exactly, re-partitioned when a run resumes at another world size (the rest of that epoch is then dealt out
sample by sample; the next epoch is dealt out by shards again).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import io
import json
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import DataLoader, Dataset

from lightning_bigtrain.data.resumable import ResumableDistributedSampler
from lightning_bigtrain.functional.memory import parse_bytes

__all__ = [
    "FORMAT",
    "INDEX_FILE",
    "StreamingDataset",
    "StreamingSampler",
    "read_index",
    "shard_order",
    "streaming_loader",
    "write_shards",
]

FORMAT = "bigtrain-shards"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"
_LOCAL_PROTOCOLS = ("file", "local")


def _size(value: int | str, name: str) -> int:
    """Bytes from ``4096`` or ``"64MiB"`` (:func:`~lightning_bigtrain.functional.memory.parse_bytes`'s units), at
    least one; ``name`` is the argument named in the error."""
    size = parse_bytes(value, name)
    if size < 1:
        raise ValueError(f"`{name}={value!r}`: must be at least one byte.")
    return size


# ---- the shard format ----------------------------------------------------------------------------------------
def _leaf_kind(leaf: Any) -> tuple[Any, ...]:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", leaf.dtype, tuple(leaf.shape))
    if isinstance(leaf, bool):
        return ("bool",)
    if isinstance(leaf, int):
        return ("int",)
    if isinstance(leaf, float):
        return ("float",)
    if hasattr(leaf, "__array__"):  # numpy arrays and scalars
        return _leaf_kind(torch.as_tensor(leaf))
    raise TypeError(
        f"write_shards: a sample holds a {type(leaf).__name__}; samples must be tensors, numbers, numpy arrays, "
        "or tuples/lists/dicts of them (strings and other objects: encode them as tensors first)."
    )


def _plain(sample: Any) -> Any:
    """The sample with numpy leaves as tensors and containers as plain tuple/list/dict (what weights-only
    loading accepts)."""
    if isinstance(sample, dict):
        return {str(k): _plain(v) for k, v in sample.items()}
    if isinstance(sample, tuple | list):  # named tuples become plain ones
        return (list if isinstance(sample, list) else tuple)(_plain(v) for v in sample)
    if hasattr(sample, "__array__") and not isinstance(sample, torch.Tensor):
        return torch.as_tensor(sample)
    _leaf_kind(sample)
    return sample


def _encode(samples: list[Any]) -> dict[str, Any]:
    """A shard's payload: columns of stacked leaves when every sample has the first one's structure and leaf
    shapes, else the list of samples."""
    flat = [tree_flatten(s) for s in samples]
    spec = flat[0][1]
    kinds = [_leaf_kind(leaf) for leaf in flat[0][0]]
    uniform = all(s == spec and [_leaf_kind(x) for x in leaves] == kinds for leaves, s in flat)
    if not uniform:
        return {"rows": samples}
    columns = []
    for j, kind in enumerate(kinds):
        values = [leaves[j] for leaves, _ in flat]
        if kind[0] == "tensor":
            columns.append(torch.stack(values).contiguous())
        else:
            columns.append(torch.tensor(values, dtype={"bool": torch.bool, "int": torch.int64}.get(kind[0],
                                                                                                  torch.float64)))  # fmt: skip
    skeleton = tree_unflatten(list(range(len(kinds))), spec)
    return {"skeleton": skeleton, "kinds": [k[0] for k in kinds], "columns": columns}


class _Decoded:
    """One shard in memory; ``samples(js)`` are its samples ``js`` as they were written."""

    def __init__(self, payload: dict[str, Any]) -> None:
        self.rows: list[Any] | None = payload.get("rows")
        if self.rows is None:
            leaves, self._spec = tree_flatten(payload["skeleton"])
            self._columns = [payload["columns"][i] for i in leaves]
            self._kinds = [payload["kinds"][i] for i in leaves]

            # A flat tuple of leaves (the usual ``(input, target)``) is rebuilt without the pytree machinery.
            self._flat_tuple = self._spec.type is tuple and all(c.is_leaf() for c in self._spec.children())

    def samples(self, js: list[int]) -> list[Any]:
        """The samples ``js`` as they were written: each column gathered once, then split."""
        if self.rows is not None:
            return [self.rows[j] for j in js]
        index = torch.tensor(js, dtype=torch.long)
        fields = [c[index].unbind(0) if kind == "tensor" else c[index].tolist()
                  for c, kind in zip(self._columns, self._kinds, strict=True)]  # fmt: skip
        rows = list(zip(*fields, strict=True))
        return rows if self._flat_tuple else [tree_unflatten(list(row), self._spec) for row in rows]


def _fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    import fsspec

    return fsspec.core.url_to_fs(url, **(storage_options or {}))


def _is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    return any(p in _LOCAL_PROTOCOLS for p in protocol)


def _put_whole(fs: Any, path: str, data: bytes) -> None:
    """Write ``path`` so that readers see all of it or none: a temporary file renamed over it on a local
    filesystem (an object store's PUT is already whole)."""
    if not _is_local(fs):
        with fs.open(path, "wb") as f:
            f.write(data)
        return
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def write_shards(
    dataset: Any,
    url: str,
    *,
    shard_bytes: int | str = "32MiB",
    meta: dict[str, Any] | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write a map-style dataset (anything with ``len`` and ``[i]``) as shards under ``url``; return the index.

    Args:
        dataset: The samples, in order (sample ``i`` of the shards is ``dataset[i]``).
        url: A folder as an fsspec URL (``s3://bucket/prefix``) or a local path.
        shard_bytes: Target size of a shard (its tensors' bytes); a shard holds at least one sample.
        meta: JSON-serialisable facts stored in the index (e.g. how the samples were made), read back as
            :attr:`StreamingDataset.meta`.
        overwrite: Replace a dataset already committed at ``url`` (its old shards are deleted after the new
            index is written).
        storage_options: Passed to fsspec (credentials, endpoint).

    Raises:
        FileExistsError: ``url`` holds a committed dataset and ``overwrite`` is False.
        ValueError: The dataset is empty, or an argument is out of range.
    """
    target = _size(shard_bytes, "shard_bytes")
    n = len(dataset)
    if n == 0:
        raise ValueError("write_shards: the dataset is empty; there is nothing to write.")
    if meta is not None:
        json.dumps(meta)  # fail before writing anything
    fs, root = _fs(url, storage_options)
    index_path = f"{root.rstrip('/')}/{INDEX_FILE}"
    old: list[str] = []
    if fs.exists(index_path):
        if not overwrite:
            raise FileExistsError(f"write_shards: {url} already holds a dataset ({INDEX_FILE}); pass overwrite=True "
                                  "to replace it or choose another URL.")  # fmt: skip
        old = [s["name"] for s in json.loads(fs.cat_file(index_path))["shards"]]
    fs.makedirs(root, exist_ok=True)
    stamp = f"{int(time.time())}-{os.getpid()}"  # new shard names never collide with the dataset being replaced
    shards: list[dict[str, Any]] = []

    def flush(batch: list[Any]) -> None:
        buf = io.BytesIO()
        torch.save(_encode(batch), buf)
        data = buf.getvalue()
        name = f"shard-{len(shards):05d}-{stamp}.pt" if overwrite and old else f"shard-{len(shards):05d}.pt"
        with fs.open(f"{root.rstrip('/')}/{name}", "wb") as f:
            f.write(data)
        shards.append({"name": name, "samples": len(batch), "bytes": len(data),
                       "sha256": hashlib.sha256(data).hexdigest()})  # fmt: skip

    batch: list[Any] = []
    size = 0
    for i in range(n):
        sample = _plain(dataset[i])
        batch.append(sample)
        size += sum(x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 8 for x in tree_flatten(sample)[0])
        if size >= target:
            flush(batch)
            batch, size = [], 0
    if batch:
        flush(batch)
    index = {"format": FORMAT, "version": FORMAT_VERSION, "num_samples": n, "shards": shards, "meta": meta or {}}
    _put_whole(fs, index_path, json.dumps(index, indent=1).encode())  # the commit: readers see complete datasets
    for name in set(old) - {s["name"] for s in shards}:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(f"{root.rstrip('/')}/{name}")
    return index


def read_index(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The committed index of the dataset at ``url``.

    Raises:
        FileNotFoundError: No committed dataset there.
        ValueError: The index is not this package's format.
    """
    fs, root = _fs(str(url).rstrip("/"), storage_options)
    try:
        raw = fs.cat_file(f"{root}/{INDEX_FILE}")
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{url} holds no committed dataset ({INDEX_FILE} is missing). Write one with "
            "`bigtrain data optimize SRC DST` or `lightning_bigtrain.data.write_shards`."
        ) from None
    index = json.loads(raw)
    if index.get("format") != FORMAT or index.get("version") != FORMAT_VERSION:
        raise ValueError(f"{url}/{INDEX_FILE} is not a {FORMAT} v{FORMAT_VERSION} index "
                         f"(format {index.get('format')!r}, version {index.get('version')!r}).")  # fmt: skip
    return dict(index)


# ---- the reader ----------------------------------------------------------------------------------------------
def _cache_dir(url: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    """``<cache_dir>/<hash of url>``: datasets sharing a cache folder never share a file."""
    if cache_dir is None:
        home = os.path.join(os.path.expanduser("~"), ".cache", "lightning_bigtrain")
        cache_dir = Path(os.environ.get("BIGTRAIN_CACHE") or home, "streaming")
    return Path(cache_dir, hashlib.sha1(url.encode()).hexdigest()[:16])


class StreamingDataset(Dataset[Any]):
    """A map-style dataset over the shards :func:`write_shards` wrote at ``url``.

    Give it to a DataLoader through :func:`streaming_loader` (or let this package's strategies or
    :class:`~lightning_bigtrain.callbacks.FaultTolerance` swap Lightning's sampler for a
    :class:`StreamingSampler`): that order reads each shard once per epoch per rank. Read in a random order
    it is correct but loads a shard for every few samples (it warns).

    Args:
        url: The dataset's folder, an fsspec URL or a local path.
        transform: Applied to each sample as it is read (must pickle, for loader workers).
        cache_dir: Where remote shards are downloaded, in a folder per URL (default ``$BIGTRAIN_CACHE`` or
            ``~/.cache/lightning_bigtrain``, then ``streaming``); cached files are named by their content's hash,
            so a dataset written again at the same URL is never served from stale files. Ranks and workers on one
            machine share it. Local datasets are read in place, not cached.
        cache_limit: Most bytes of shards kept in ``cache_dir``; the least recently used are deleted. At least
            ``shuffle_window + 1`` of the largest shard.
        shuffle_window: Shards whose samples are shuffled together by :class:`StreamingSampler` (more: a
            better shuffle, more shards in memory per loader worker).
        storage_options: Passed to fsspec (credentials, endpoint URL, ...).

    Raises:
        FileNotFoundError: No committed dataset at ``url``.
        ValueError: The index is not this package's format, or an argument is out of range.
    """

    def __init__(
        self,
        url: str,
        *,
        transform: Callable[[Any], Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str = "8GiB",
        shuffle_window: int = 4,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if shuffle_window < 1:
            raise ValueError(f"`StreamingDataset(shuffle_window={shuffle_window})`: must be >= 1.")
        self.url = str(url).rstrip("/")
        self.transform = transform
        self.shuffle_window = shuffle_window
        self.storage_options = dict(storage_options or {})
        self.cache_limit = _size(cache_limit, "cache_limit")
        fs, self._root = _fs(self.url, self.storage_options)
        self.local = _is_local(fs)
        index = read_index(self.url, self.storage_options)
        self.shards: list[dict[str, Any]] = index["shards"]
        self.meta: dict[str, Any] = index.get("meta", {})
        self.shard_sizes = [int(s["samples"]) for s in self.shards]
        self._starts = [0]
        for size in self.shard_sizes:
            self._starts.append(self._starts[-1] + size)
        if self._starts[-1] != index["num_samples"]:
            raise ValueError(f"StreamingDataset: {self.url}/{INDEX_FILE} is inconsistent (its shards hold "
                             f"{self._starts[-1]} samples, it says {index['num_samples']}).")  # fmt: skip
        largest = max(int(s["bytes"]) for s in self.shards)
        if not self.local and self.cache_limit < (shuffle_window + 1) * largest:
            raise ValueError(
                f"`StreamingDataset(cache_limit={cache_limit!r})` holds fewer than shuffle_window + 1 = "
                f"{shuffle_window + 1} shards of {largest} bytes (the largest of {self.url}): raise cache_limit to "
                f"at least {(shuffle_window + 1) * largest} bytes or lower shuffle_window."
            )
        self.cache_dir = None if self.local else _cache_dir(self.url, cache_dir)
        self._memory: OrderedDict[int, _Decoded] = OrderedDict()
        self._fs_pid: tuple[int, Any] | None = None
        self.loads = 0  # shards decoded by this process
        self.served = 0  # samples read by this process
        self._mark = (0, 0)  # (loads, served) when the order was last judged
        self._hashed: set[int] = set()  # shards whose bytes this process checked against the index's hash

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> Any:
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """A batch of samples (the DataLoader asks for whole batches): each shard's part gathered at once."""
        out: list[Any] = [None] * len(indices)
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for pos, i in enumerate(indices):
            k = self.shard_of(i)
            by_shard.setdefault(k, []).append((pos, i % len(self) - self._starts[k]))
        for k, items in by_shard.items():
            for (pos, _), sample in zip(items, self._shard(k).samples([j for _, j in items]), strict=True):
                out[pos] = sample
        self.served += len(indices)
        if self.transform is not None:
            out = [self.transform(sample) for sample in out]
        return out

    def __getstate__(self) -> dict[str, Any]:  # loader workers start with an empty memory and their own fs
        state = self.__dict__.copy()
        state.update(_memory=OrderedDict(), _fs_pid=None, loads=0, served=0, _mark=(0, 0), _hashed=set())
        return state

    # ---- shards --------------------------------------------------------------------------------------------
    def shard_of(self, i: int) -> int:
        """The shard holding sample ``i`` (negative: from the end)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"StreamingDataset index {i} is out of range for {n} samples.")
        return bisect.bisect_right(self._starts, i % n) - 1

    def _filesystem(self) -> Any:
        if self._fs_pid is None or self._fs_pid[0] != os.getpid():  # fsspec clients do not survive a fork
            import fsspec

            protocol = fsspec.utils.get_protocol(self.url)
            cls = fsspec.get_filesystem_class(protocol)
            options = dict(self.storage_options)
            if hasattr(cls, "clear_instance_cache"):
                options["skip_instance_cache"] = True
            self._fs_pid = (os.getpid(), fsspec.core.url_to_fs(self.url, **options)[0])
        return self._fs_pid[1]

    def _shard(self, k: int) -> _Decoded:
        if k in self._memory:
            self._memory.move_to_end(k)
            return self._memory[k]
        decoded = _Decoded(torch.load(io.BytesIO(self._read(k)), weights_only=True))
        self._memory[k] = decoded
        while len(self._memory) > self.shuffle_window + 1:
            self._memory.popitem(last=False)
        self.loads += 1
        self._check_order()
        return decoded

    def _read(self, k: int) -> bytes:
        shard = self.shards[k]
        if self.local:
            with self._filesystem().open(f"{self._root}/{shard['name']}", "rb") as f:
                return self._verified(k, f.read())
        assert self.cache_dir is not None
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self.cache_dir / f"{Path(shard['name']).stem}.{shard['sha256'][:16]}.pt"
        with _locked(path):
            if path.exists():
                try:
                    data = self._verified(k, path.read_bytes())
                except OSError:  # the cached copy is damaged, not the shard: fetched again below
                    path.unlink()
                else:
                    os.utime(path)  # most recently used
                    return data
            fd, tmp = tempfile.mkstemp(dir=self.cache_dir, prefix=f".{shard['name']}.", suffix=".part")
            os.close(fd)
            try:
                self._filesystem().get_file(f"{self._root}/{shard['name']}", tmp)
                data = self._verified(k, Path(tmp).read_bytes())
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(tmp)
        self._evict(keep=path)
        return data

    def _verified(self, k: int, data: bytes) -> bytes:
        """``data`` if it is shard ``k`` as the index describes it: its size every time, its SHA-256 the first time
        this process reads it (a loader worker reads each of its shards once per epoch)."""
        shard = self.shards[k]
        if len(data) != shard["bytes"] or (k not in self._hashed and hashlib.sha256(data).hexdigest() != shard["sha256"]):
            raise OSError(f"StreamingDataset: shard {shard['name']} of {self.url} is damaged ({len(data)} bytes, "
                          f"the index says {shard['bytes']}, or its SHA-256 differs); write the dataset again.")  # fmt: skip
        self._hashed.add(k)
        return data

    def _evict(self, keep: Path) -> None:
        """Delete the least recently used shards until the cache is under ``cache_limit``; shards another
        process holds the lock of (downloading or reading them) are left."""
        assert self.cache_dir is not None
        files = []
        for p in self.cache_dir.glob("*.pt"):
            with contextlib.suppress(FileNotFoundError):
                st = p.stat()
                files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.cache_limit:
                break
            if p == keep:
                continue
            with _locked(p, block=False) as got:
                if got:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
                        total -= size

    def _check_order(self) -> None:
        # In StreamingSampler's order each of L loader workers decodes every shard of its rank's stream once
        # per epoch, i.e. one load per (shard size / L) samples; a random order loads one per few samples.
        # Judged over the last 16 loads.
        if self.loads - self._mark[0] < 16:
            return
        loads, served = self.loads - self._mark[0], self.served - self._mark[1]
        self._mark = (self.loads, self.served)
        if served * 16 < loads * (len(self) / len(self.shards)):
            from lightning_bigtrain.warnings import warn_once

            warn_once(
                f"StreamingDataset({self.url!r}) is read in an order that loads a shard every "
                f"{max(served, 1) // loads} samples: give it to a DataLoader through "
                "`lightning_bigtrain.data.streaming_loader(...)` (or train under a lightning_bigtrain strategy "
                "or with FaultTolerance(), which give it a StreamingSampler).",
                UserWarning,
            )


@contextlib.contextmanager
def _locked(path: Path, block: bool = True) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path``'s lock file, shared by every process of this machine."""
    lock = path.with_name(f".{path.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if block else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ---- the order -----------------------------------------------------------------------------------------------
def shard_order(shard_sizes: list[int], world_size: int, seed: int | None, shuffle_window: int = 4) -> list[int]:
    """An epoch's global sample list for ``world_size`` ranks: ``order[rank::world_size]`` is rank ``rank``'s stream.

    Shards (shuffled with ``seed`` unless it is None) are dealt to the ranks, each to the rank with the fewest
    samples so far; a rank's samples are shuffled within each run of ``shuffle_window`` of its shards; the
    streams are then evened out (the longest give their last samples to the shortest) to lengths that differ
    by at most one, the longer ones first, and interleaved. Without ``seed`` the shards are split in order into
    contiguous, equal ranges. Every sample appears exactly once.
    """
    n = sum(shard_sizes)
    starts = [0]
    for size in shard_sizes:
        starts.append(starts[-1] + size)
    targets = [n // world_size + (1 if r < n % world_size else 0) for r in range(world_size)]
    if seed is None:
        bounds = [sum(targets[:r]) for r in range(world_size + 1)]
        streams = [list(range(bounds[r], bounds[r + 1])) for r in range(world_size)]
    else:
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(shard_sizes), generator=g).tolist()
        owned: list[list[int]] = [[] for _ in range(world_size)]
        load = [0] * world_size
        for k in perm:
            r = min(range(world_size), key=lambda q: (load[q], q))
            owned[r].append(k)
            load[r] += shard_sizes[k]
        streams = []
        for shards in owned:
            stream: list[int] = []
            for w in range(0, len(shards), shuffle_window):
                window = [i for k in shards[w : w + shuffle_window] for i in range(starts[k], starts[k + 1])]
                stream += [window[j] for j in torch.randperm(len(window), generator=g).tolist()]
            streams.append(stream)
        spill: list[int] = []
        for r, stream in enumerate(streams):
            if len(stream) > targets[r]:
                spill += stream[targets[r] :]
                del stream[targets[r] :]
        for r, stream in enumerate(streams):
            need = targets[r] - len(stream)
            stream += spill[:need]
            del spill[:need]
    order = [0] * n
    for r, stream in enumerate(streams):
        order[r::world_size] = stream
    return order


class StreamingSampler(ResumableDistributedSampler):
    """The order of a :class:`StreamingDataset` (see :func:`shard_order`), resumable like every sampler of this
    package. A ``DistributedSampler``, so Lightning leaves it in place.

    Args:
        dataset: The streaming dataset.
        num_replicas: World size (default: the process group's, 1 without one).
        rank: This rank (default: the process group's, 0 without one).
        shuffle: Shuffle shards and samples with ``seed + epoch``.
        seed: Shuffle seed, the same on every rank (default: ``$PL_GLOBAL_SEED`` as Lightning's, else 0).
        drop_last: Drop the tail instead of padding it (as ``DistributedSampler``).
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise TypeError(f"StreamingSampler orders a StreamingDataset, not a {type(dataset).__name__}.")
        initialized = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialized else 1
        if rank is None:
            rank = dist.get_rank() if initialized else 0
        if seed is None:
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)  # fmt: skip
        self._memo: tuple[tuple[int, int | None], list[int]] | None = None  # the last list made, by its key

    order = "shards"

    def _epoch_indices(self) -> list[int]:
        # Made again for each len() and iteration of the epoch otherwise (a resumed epoch asks several times).
        key = (self.list_world_size(), self.seed + self.epoch if self.shuffle else None)
        if self._memo is None or self._memo[0] != key:
            ds: StreamingDataset = self.dataset  # type: ignore[assignment]
            self._memo = (key, shard_order(ds.shard_sizes, key[0], key[1], ds.shuffle_window))
        return self._memo[1]


def streaming_loader(
    dataset: StreamingDataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int | None = None,
    drop_last: bool = False,
    num_workers: int = 0,
    **kwargs: Any,
) -> DataLoader:
    """A DataLoader over ``dataset`` in :class:`StreamingSampler`'s order for this process's rank (call it where
    the process group exists, e.g. in ``train_dataloader``). ``kwargs`` go to ``DataLoader``."""
    sampler = StreamingSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, num_workers=num_workers,
                      persistent_workers=num_workers > 0, **kwargs)  # fmt: skip
