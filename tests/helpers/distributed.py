"""Run a function on N CPU ranks joined by a gloo process group, and collect what each returns.

Starting a rank costs about 7 s on the 2-core CI host (importing torch and Lightning), more than most of
the tiny fits the tests run in it. The ranks are therefore kept between calls: one pool of ``world_size``
spawned workers per world size, each call on a fresh port and a fresh process group, with the process
state a test can change (environment, deterministic-algorithms flag, default dtype, thread count, fsspec's
cached filesystems) put back and the task's garbage collected afterwards. A rank that raises or dies takes
its pool down (peers may be blocked in a collective), and the next call starts a new one.
``BIGTRAIN_TEST_FRESH_RANKS=1`` (or ``fresh=True``) spawns new processes for every call instead.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import socket
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["free_port", "run_on_ranks"]


_PORT_BLOCK = 500  # ports per test process
_next_port: int | None = None


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A free local port for a rendezvous, from a block of its own for this test process.

    A port the kernel hands out for ``bind(0)`` comes from the ephemeral range, from which it also picks the local
    port of every outgoing connection: between choosing such a port and the rendezvous server binding it, another
    test process's gloo connection could take it (``EADDRINUSE``). The ports here lie below the ephemeral range,
    where only explicit binds land, in a block per pytest-xdist worker (per process id outside xdist)."""
    global _next_port
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 16 + os.getpid() % 8
    low = _ephemeral_start() - (index + 1) * _PORT_BLOCK
    if low < 10000:  # an unusual ephemeral range: leave the choice to the kernel
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    if _next_port is None:
        _next_port = os.getpid() % _PORT_BLOCK
    for _ in range(_PORT_BLOCK):
        port = low + _next_port
        _next_port = (_next_port + 1) % _PORT_BLOCK
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {low}..{low + _PORT_BLOCK - 1}")


def _run_task(rank: int, world_size: int, task: bytes) -> tuple[str, Any]:
    try:
        fn, args, port, init_process_group, env = pickle.loads(task)
        os.environ.clear()
        os.environ.update(env)  # the caller's, as a freshly spawned process would inherit it
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world_size),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
        )
        if init_process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        return "ok", fn(rank, *args)
    except BaseException:
        return "error", traceback.format_exc()


def _clear_fsspec_instances() -> None:
    fsspec = sys.modules.get("fsspec")
    if fsspec is None:
        return
    todo = [fsspec.AbstractFileSystem]
    while todo:
        cls = todo.pop()
        cls.clear_instance_cache()
        todo.extend(cls.__subclasses__())


def _destroy_process_group() -> None:
    """Destroy the task's process group; through DeepSpeed when it holds references to it (its cached
    groups would otherwise outlive the group, and the next task's engine would use them)."""
    ds = sys.modules.get("deepspeed.comm.comm")
    if ds is not None and ds.cdb is not None and ds.cdb.is_initialized():
        ds.destroy_process_group()
    if dist.is_initialized():
        dist.destroy_process_group()
    if "deepspeed.utils.groups" in sys.modules:  # the group may have been destroyed behind DeepSpeed's back
        from lightning_bigtrain.strategies.deepspeed_zero import _release_stale_deepspeed_groups

        _release_stale_deepspeed_groups(force=True)


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding and redistribution plans keyed by ``DeviceMesh``, whose equality ignores its process
    groups: a later task's mesh over the same ranks would reuse plans naming the destroyed task's groups (another
    group, or none, under the same name)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _gen_transform_infos.cache_clear()


def _worker(rank: int, world_size: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    env = dict(os.environ)
    deterministic = torch.are_deterministic_algorithms_enabled()
    dtype = torch.get_default_dtype()
    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:  # the parent is gone
            os._exit(0)
        if task == b"stop":
            os._exit(0)
        status, value = _run_task(rank, world_size, task)
        if status == "error":
            # Peers may wait in a collective forever: report, and let the parent take the pool down.
            conn.send_bytes(pickle.dumps((status, value)))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        _destroy_process_group()
        _clear_dtensor_caches()
        try:
            payload = pickle.dumps((status, value))
        except Exception:
            payload = pickle.dumps(("error", f"rank {rank}: result not picklable\n{traceback.format_exc()}"))
        conn.send_bytes(payload)
        sys.stdout.flush()
        sys.stderr.flush()
        os.environ.clear()
        os.environ.update(env)
        _clear_fsspec_instances()  # filesystems read credentials and endpoints from the environment
        gc.collect()  # the task's garbage goes now, not inside the next task's measurements
        torch.use_deterministic_algorithms(deterministic)
        torch.set_default_dtype(dtype)
        torch.set_num_threads(1)


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, world_size, child), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], init_process_group: bool) -> list[Any]:
        task = pickle.dumps((fn, args, free_port(), init_process_group, dict(os.environ)))
        for conn in self.conns:
            conn.send_bytes(task)
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending:
            ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending])
            for rank in sorted(pending):
                conn, proc = self.conns[rank], self.procs[rank]
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    status, value = pickle.loads(conn.recv_bytes())
                    if status == "error":
                        raise RuntimeError(f"rank {rank} of {self.world_size} failed:\n{value}")
                    results[rank] = value
                    pending.discard(rank)
                elif proc.sentinel in ready:
                    raise RuntimeError(f"rank {rank} of {self.world_size} exited with code {proc.exitcode}")
        return results

    def close(self, kill: bool = False) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            if not kill and proc.is_alive():
                with contextlib.suppress(OSError):
                    conn.send_bytes(b"stop")
        for proc in self.procs:
            proc.join(timeout=0 if kill else 5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


_POOLS: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def run_on_ranks(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    init_process_group: bool = True,
    fresh: bool = False,
) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` CPU processes; return the results by rank.

    The environment of each rank carries MASTER_ADDR/PORT, WORLD_SIZE, RANK and LOCAL_RANK, so a
    ``lightning.Trainer(strategy="ddp", devices=world_size)`` built inside ``fn`` joins these processes
    instead of launching its own (pass ``init_process_group=False`` then: Lightning makes the group).
    ``fn`` and its arguments must be picklable (module-level). An exception on any rank fails the call
    with that rank's traceback. The processes are reused by later calls (see the module docstring);
    ``fresh=True`` gives the call processes of its own.
    """
    fresh = fresh or os.environ.get("BIGTRAIN_TEST_FRESH_RANKS") == "1"
    pool = None if fresh else _POOLS.pop(world_size, None)
    if pool is not None and not pool.alive():
        pool.close(kill=True)
        pool = None
    pool = pool or _Pool(world_size)
    try:
        results = pool.run(fn, args, init_process_group)
    except BaseException:
        pool.close(kill=True)
        raise
    if fresh:
        pool.close()
    else:
        _POOLS[world_size] = pool
    return results
