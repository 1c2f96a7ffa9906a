"""Atomic checkpoints: written under a temporary name, committed last, never half-visible.

Every checkpoint this package writes (one file, a torch distributed-checkpoint folder, a DeepSpeed folder; a
local path or an fsspec URL) goes through here:

* **A file** is written to ``<path>.partial-<id>`` and renamed over ``<path>`` (``os.replace``, atomic on
  a POSIX filesystem). On object stores (``s3://``) the file is uploaded under its own name: an object
  becomes visible whole, when its upload completes.
* **A folder** is written to ``<path>.partial-<id>/`` by every rank; rank 0 then writes a commit marker
  (``.bigtrain-commit.json``, a manifest of every file with its size), renames the folder to
  ``<path>.data-<id>/`` and replaces ``<path>`` by a symbolic link to it (created under a temporary name and
  renamed over the old link: atomic), since a rename cannot replace a non-empty folder. On object stores,
  which have neither rename nor links, the folder is written at ``<path>.data-<id>/`` directly and
  ``<path>`` becomes a small *pointer* object naming it, written after the marker.
* The data the old link or pointer named is deleted only after the new one is committed.

A kill at any moment leaves ``<path>`` naming either the previous committed checkpoint or the new one.
:func:`load_path` checks what ``<path>`` names (marker present, every listed file at its size); an
uncommitted or damaged checkpoint is skipped with a warning naming it, and the newest committed checkpoint
in the same folder is loaded instead. :func:`latest_checkpoint` finds the newest committed one.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import uuid
from collections.abc import Callable
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_bigtrain.warnings import BigtrainWarning, warn_once

__all__ = [
    "COMMIT_MARKER",
    "AsyncCommits",
    "AtomicCheckpointIO",
    "CheckpointDamagedWarning",
    "atomic_folder_save",
    "is_committed",
    "latest_checkpoint",
    "load_path",
    "remove_checkpoint",
]

COMMIT_MARKER = ".bigtrain-commit.json"
POINTER_KEY = "bigtrain_checkpoint"
_PARTIAL = ".partial-"
_DATA = ".data-"
_LINK = ".link-"
_EXTENSION = ".ckpt"
# Test-only fault injection: called with a fault-point name ("save_before_commit", "save_after_commit").
fault_hook: Callable[[str], None] | None = None


class CheckpointDamagedWarning(BigtrainWarning):
    """A checkpoint named for loading was not committed or is damaged; another one is loaded instead."""


def _fault(point: str) -> None:
    if fault_hook is not None:
        fault_hook(point)


def _fs(path: str) -> Any:
    from lightning.fabric.utilities.cloud_io import get_filesystem

    return get_filesystem(path)


def _is_local(path: str) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(_fs(path), LocalFileSystem)


def _local(path: str) -> str:
    """A local path without a ``file://`` scheme."""
    return path[len("file://") :] if path.startswith("file://") else path


def new_id() -> str:
    return uuid.uuid4().hex[:12]


def _fsync_tree(root: str) -> None:
    """Flush every file under ``root`` (a file or folder) and the folders themselves to the disk."""
    paths = [root] if os.path.isfile(root) else [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    _fsync_dir(root if os.path.isdir(root) else os.path.dirname(root) or ".")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- manifest -----------------------------------------------------------------------------------------
def _manifest(fs: Any, folder: str) -> dict[str, int]:
    root = fs._strip_protocol(folder).rstrip("/")
    files: dict[str, int] = {}
    for path, info in fs.find(root, detail=True).items():
        rel = path[len(root) + 1 :]
        if posixpath.basename(rel) != COMMIT_MARKER:
            files[rel] = int(info["size"])
    return files


def _write_marker(fs: Any, folder: str) -> None:
    marker = {"version": 1, "files": _manifest(fs, folder)}
    with fs.open(f"{folder.rstrip('/')}/{COMMIT_MARKER}", "w") as f:
        json.dump(marker, f)


def _verify_folder(fs: Any, folder: str) -> str | None:
    """None when the folder is committed and whole, else why not."""
    marker_path = f"{folder.rstrip('/')}/{COMMIT_MARKER}"
    if not fs.exists(marker_path):
        return "no commit marker (the save did not finish)"
    try:
        with fs.open(marker_path, "r") as f:
            files = json.load(f)["files"]
    except (ValueError, KeyError, OSError) as err:
        return f"unreadable commit marker ({err})"
    for rel, size in files.items():
        path = f"{folder.rstrip('/')}/{rel}"
        if not fs.exists(path):
            return f"{rel} is missing"
        actual = fs.size(path)
        if actual != size:
            return f"{rel} has {actual} bytes, the manifest says {size}"
    return None


def _read_pointer(fs: Any, path: str) -> str | None:
    """The data folder a pointer object names (object stores), or None if ``path`` is not a pointer."""
    try:
        if fs.isdir(path) or fs.size(path) > 4096:
            return None
        with fs.open(path, "rb") as f:
            content = json.loads(f.read().decode())
    except (ValueError, UnicodeDecodeError, OSError):
        return None
    if not isinstance(content, dict) or POINTER_KEY not in content:
        return None
    return f"{posixpath.dirname(path.rstrip('/'))}/{content[POINTER_KEY]}"


# ---- what a name points to ------------------------------------------------------------------------------
def _target(path: str) -> str:
    """Where the checkpoint named ``path`` is stored (follows our link or pointer)."""
    if _is_local(path):
        local = _local(path)
        return os.path.realpath(local) if os.path.islink(local) else local
    fs = _fs(path)
    return _read_pointer(fs, path) or path


def _problem(path: str) -> str | None:
    """None when ``path`` names a committed, whole checkpoint; else what is wrong with it."""
    fs = _fs(path)
    target = _target(path)
    if _is_local(path):
        local = _local(path)
        if os.path.islink(local) and not os.path.exists(local):
            return "its link points to nothing"
        if not os.path.exists(target):
            return "it does not exist"
        if os.path.isdir(target):
            if _DATA in os.path.basename(target) or os.path.exists(os.path.join(target, COMMIT_MARKER)):
                return _verify_folder(fs, target)
            return None  # a folder written by another tool (no marker): taken as it is
        return None if os.path.getsize(target) > 0 else "it is empty"
    if not fs.exists(target):
        return "it does not exist"
    if fs.isdir(target):
        if target != path or fs.exists(f"{target.rstrip('/')}/{COMMIT_MARKER}"):
            return _verify_folder(fs, target)
        return None
    return None


def is_committed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a committed, whole checkpoint (file, folder, link or pointer)."""
    return _problem(str(path)) is None


def _mtime(path: str) -> float:
    fs = _fs(path)
    target = _target(path)
    marker = f"{target.rstrip('/')}/{COMMIT_MARKER}"
    probe = marker if fs.exists(marker) else target
    try:
        return float(fs.modified(probe).timestamp())
    except (NotImplementedError, OSError, AttributeError, FileNotFoundError):
        return 0.0


def latest_checkpoint(
    dirpath: str | os.PathLike[str], exclude: tuple[str, ...] = (), prefer_prefix: str | None = None
) -> str | None:
    """The newest committed checkpoint (``*.ckpt``: file, folder, link or pointer) in ``dirpath``, or None.
    With ``prefer_prefix``, the newest committed one whose name starts with it, if there is one."""
    dirpath = str(dirpath)
    fs = _fs(dirpath)
    if not fs.exists(dirpath):
        return None
    excluded = {os.path.normpath(_local(e)) for e in exclude}
    best: tuple[bool, float, str] | None = None
    for entry in fs.ls(dirpath, detail=False):
        name = posixpath.basename(entry.rstrip("/"))
        if not name.endswith(_EXTENSION) or _PARTIAL in name or _DATA in name or _LINK in name:
            continue
        path = os.path.join(dirpath, name) if _is_local(dirpath) else f"{dirpath.rstrip('/')}/{name}"
        if os.path.normpath(_local(path)) in excluded or not is_committed(path):
            continue
        key = (prefer_prefix is not None and name.startswith(prefer_prefix), _mtime(path), path)
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else best[2]


def load_path(path: str | os.PathLike[str]) -> str:
    """The location to load for the checkpoint named ``path``: its own when committed and whole; otherwise,
    with a :class:`CheckpointDamagedWarning` naming it, the newest committed checkpoint beside it."""
    path = str(path)
    problem = _problem(path)
    if problem is None:
        return _target(path)
    parent = os.path.dirname(_local(path)) if _is_local(path) else posixpath.dirname(path.rstrip("/"))
    fallback = latest_checkpoint(parent, exclude=(path,))
    if fallback is None:
        raise FileNotFoundError(
            f"Checkpoint {path!r} cannot be loaded: {problem}, and {parent!r} holds no other committed "
            "checkpoint. Start without ckpt_path, or pass a committed checkpoint."
        )
    warn_once(
        f"Checkpoint {path!r} is skipped: {problem}. Loading the newest committed checkpoint instead: {fallback!r}.",
        CheckpointDamagedWarning,
    )
    return _target(fallback)


# ---- writing -----------------------------------------------------------------------------------------------
def clear_stale(path: str) -> None:
    """Remove what killed saves of ``path`` left behind: partial folders/files and data no link names."""
    fs = _fs(path)
    parent = os.path.dirname(_local(path)) if _is_local(path) else posixpath.dirname(path.rstrip("/"))
    if not fs.exists(parent):
        return
    name = posixpath.basename(path.rstrip("/"))
    current = posixpath.basename(_target(path).rstrip("/"))
    for entry in fs.ls(parent, detail=False):
        base = posixpath.basename(entry.rstrip("/"))
        stale = base.startswith(name + _PARTIAL) or base.startswith(name + _LINK)
        stale |= base.startswith(name + _DATA) and base != current
        if stale:
            _remove_any(os.path.join(parent, base) if _is_local(path) else f"{parent}/{base}")


def _remove_any(path: str) -> None:
    if _is_local(path):
        local = _local(path)
        if os.path.islink(local) or os.path.isfile(local):
            os.remove(local)
        elif os.path.isdir(local):
            shutil.rmtree(local, ignore_errors=True)
        return
    fs = _fs(path)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def staging_path(path: str, save_id: str) -> str:
    """Where a save of ``path`` writes before its commit."""
    return f"{path}{_PARTIAL}{save_id}" if _is_local(path) else f"{path}{_DATA}{save_id}"


def commit(path: str, staging: str, *, folder: bool) -> None:
    """Make the data written at ``staging`` the checkpoint named ``path`` (rank 0, after every rank wrote)."""
    fs = _fs(path)
    previous = _target(path) if (fs.exists(path) or os.path.islink(_local(path))) else None
    if folder:
        _write_marker(fs, staging)
    _fault("save_before_commit")
    if _is_local(path):
        local, staged = _local(path), _local(staging)
        _fsync_tree(staged)
        if folder:
            head, tail = os.path.split(staged)
            data = os.path.join(head, tail.replace(_PARTIAL, _DATA))
            os.rename(staged, data)
            link = os.path.join(head, tail.replace(_PARTIAL, _LINK))
            os.symlink(os.path.basename(data), link)
            if os.path.isdir(local) and not os.path.islink(local):
                # A folder written in place (by another tool or version): moved aside, then replaced.
                aside = f"{local}{_DATA}{new_id()}"
                os.rename(local, aside)
                previous = aside
            os.replace(link, local)
        else:
            if os.path.isdir(local) and not os.path.islink(local):
                aside = f"{local}{_DATA}{new_id()}"
                os.rename(local, aside)
                previous = aside
            os.replace(staged, local)
        _fsync_dir(os.path.dirname(os.path.abspath(local)))
        previous_local = previous if previous is None else _local(previous)
        if previous_local is not None and os.path.abspath(previous_local) not in (
            os.path.abspath(local),
            os.path.abspath(_target(path)),
        ):
            _remove_any(previous_local)
    elif folder:
        if fs.exists(path) and fs.isdir(path):  # a folder written in place earlier: no pointer can replace it
            fs.rm(path, recursive=True)
        with fs.open(path, "w") as f:
            json.dump({POINTER_KEY: posixpath.basename(staging.rstrip("/"))}, f)
        if previous is not None and previous.rstrip("/") not in (path.rstrip("/"), staging.rstrip("/")):
            _remove_any(previous)
    _fault("save_after_commit")


def remove_checkpoint(path: str | os.PathLike[str]) -> None:
    """Delete the checkpoint named ``path``: its data, then its link or pointer."""
    path = str(path)
    target = _target(path)
    if target.rstrip("/") != path.rstrip("/"):
        _remove_any(target)
    _remove_any(path)


def atomic_folder_save(strategy: Any, filepath: Any, write: Callable[[str], None]) -> None:
    """Save a checkpoint folder through ``write(staging)`` on every rank of ``strategy``, then commit it on
    rank 0. Collective: every rank calls it with the same ``filepath``."""
    location = str(strategy.broadcast(str(filepath)))
    save_id = strategy.broadcast(new_id())
    staging = staging_path(location, save_id)
    if strategy.is_global_zero:
        clear_stale(location)
    strategy.barrier()
    write(staging)
    strategy.barrier()
    if strategy.is_global_zero:
        commit(location, staging, folder=True)
    strategy.barrier()


class AsyncCommits:
    """Folder saves whose shards are still being written in the background (``dcp.async_save``): each is
    committed by rank 0 once its write has finished on every rank, in the order they were started; removals of
    older checkpoints asked for meanwhile wait until then (a checkpoint is deleted only after a newer one is
    committed). A job killed before a commit resumes from the previous committed checkpoint."""

    def __init__(self) -> None:
        self._pending: list[tuple[str, str, Any]] = []  # (name, staging, future)
        self._removals: list[str] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, location: str, staging: str, future: Any) -> None:
        self._pending.append((location, staging, future))

    def defer_removal(self, path: str) -> bool:
        """Queue ``path`` for removal after the pending commits; False when nothing is pending."""
        if not self._pending:
            return False
        self._removals.append(path)
        return True

    def poll(self, is_global_zero: bool, block: bool = False) -> None:
        """Commit the finished saves (all of them with ``block``), oldest first.

        On rank 0 a finished future means every rank's shards are written: DCP's coordinator finishes a save
        only after gathering every rank's write results. Local, no collective.
        """
        while self._pending and (block or self._pending[0][2].done()):
            location, staging, future = self._pending.pop(0)
            future.result()  # a failed write raises here, and the checkpoint is not committed
            if is_global_zero:
                commit(location, staging, folder=True)
        if not self._pending:
            removals, self._removals = self._removals, []
            if is_global_zero:
                for path in removals:
                    remove_checkpoint(path)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` writing single-file checkpoints atomically (see the module docstring).

    Loading goes through :func:`load_path` (an uncommitted or damaged checkpoint is skipped with a warning
    for the newest committed one); removing deletes a link's data with the link. It is the default
    ``checkpoint_io`` of this package's strategies and is installed by
    :class:`~lightning_bigtrain.callbacks.FaultTolerance` for Lightning's own.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        path = str(path)
        if not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)  # an object appears whole, when uploaded
            return
        os.makedirs(os.path.dirname(os.path.abspath(_local(path))), exist_ok=True)
        clear_stale(path)
        staging = staging_path(path, new_id())
        super().save_checkpoint(checkpoint, staging, storage_options)
        commit(path, staging, folder=False)

    @override
    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"weights_only": weights_only}
        if map_location is not None:
            kwargs["map_location"] = map_location
        return super().load_checkpoint(load_path(str(path)), **kwargs)

    @override
    def remove_checkpoint(self, path: Any) -> None:
        remove_checkpoint(str(path))
