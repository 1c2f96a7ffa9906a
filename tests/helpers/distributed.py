"""Run a function on N spawned CPU ranks joined by a gloo process group, and collect what each returns."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_on_ranks"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_entry(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    port: int,
    init_process_group: bool,
    outdir: str,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    if init_process_group:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(Path(outdir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    # The result is on disk: leave without interpreter teardown, where native threads of the process
    # group have been seen (rarely) to abort the process after all work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, init_process_group: bool = True) -> list[Any]:
    """Call ``fn(rank, *args)`` on ``world_size`` spawned processes; return the results by rank.

    The environment of each rank carries MASTER_ADDR/PORT, WORLD_SIZE, RANK and LOCAL_RANK, so a
    ``lightning.Trainer(strategy="ddp", devices=world_size)`` built inside ``fn`` joins these processes
    instead of launching its own (pass ``init_process_group=False`` then: Lightning makes the group).
    ``fn`` and its arguments must be picklable (module-level). An exception on any rank fails the call
    with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _rank_entry,
            args=(fn, args, world_size, free_port(), init_process_group, outdir),
            nprocs=world_size,
            start_method="spawn",
            join=True,
        )
        results = []
        for rank in range(world_size):
            with open(Path(outdir) / f"rank{rank}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results
