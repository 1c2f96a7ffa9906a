"""Chaos harness: a 2-rank fit killed at seeded fault points, relaunched with auto-resume, compared bit for bit.

A *job* is one ``python -m tests.helpers.chaos ...`` process tree: rank 0 runs the script and Lightning's
subprocess launcher starts rank 1 from it, in the same process group. A row of several "nodes"
(``Setting.num_nodes``) is a job whose first process starts one such launch per node, on this host, all in the
job's process group. A fault takes the **whole job** down with ``SIGKILL`` on the process group (as a scheduler
would), at one of the named points of the global step it is set for, on the (global) rank it names:

* ``batch_start``: a training batch is fetched, nothing computed yet;
* ``step``: inside the step, after backward and before the optimizer step;
* ``save_before_commit``: inside a checkpoint save, every rank's data written, the commit not yet made;
* ``save_after_commit``: right after a checkpoint's commit;
* ``timed``: the harness kills the job after a seeded random delay, wherever it is then.

:func:`run_chaos` runs the uninterrupted job, then jobs with one fault each (seeded choices of point, step
and killing rank; steps increase so each fault is reached), then a job without fault that finishes the run
from the newest committed checkpoint, and compares every rank's final parameters and buffers with the
uninterrupted run's (``torch.equal``). Checkpoints are taken every ``every`` steps by Lightning's own
``ModelCheckpoint(every_n_train_steps=every, save_last=True)``, mid-epoch; every job is started with
``ckpt_path="last"``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POINTS = ("batch_start", "step", "save_before_commit", "save_after_commit")
_SAVE_POINTS = ("save_before_commit", "save_after_commit")
_REPO = Path(__file__).resolve().parents[2]
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
               "GROUP_RANK")  # fmt: skip


@dataclass
class ChaosResult:
    """What one chaos run of a settings row did."""

    setting: str
    faults: list[tuple[str, int, int]]
    returncodes: list[int]
    resumed_from: list[int]
    mid_epoch_resumes: int
    identical: bool
    max_abs_diff: float
    seconds: float
    notes: list[str] = field(default_factory=list)
    logs_identical: bool | None = None  # with ``csv_log``: the CSV log ends as the uninterrupted job's

    @property
    def kills_survived(self) -> int:
        return sum(1 for rc in self.returncodes[:-1] if rc == -signal.SIGKILL)


def _kill_job() -> None:
    sys.stdout.flush()
    os.killpg(os.getpgid(0), signal.SIGKILL)


# ---- the job (runs inside each rank) ------------------------------------------------------------------------
def _job(args: argparse.Namespace) -> int:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_bigtrain import checkpointing
    from lightning_bigtrain.callbacks import FaultTolerance
    from lightning_bigtrain.strategies._fault import FaultTolerantStrategyMixin
    from tests.helpers.settings import by_name

    torch.set_num_threads(1)
    # The global rank (a launch of several nodes sets NODE_RANK; Lightning sets LOCAL_RANK for the ranks it starts).
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    rank = int(os.environ.get("NODE_RANK", 0)) * args.devices + local_rank
    fault = None
    if args.fault:
        point, step, fault_rank = args.fault.split("@")
        fault = (point, int(step), int(fault_rank))

    class Chaos(L.Callback):
        start_step = -1

        def _maybe(self, trainer: L.Trainer, point: str) -> None:
            if fault and fault[0] == point and trainer.global_step == fault[1] and rank == fault[2]:
                _kill_job()

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.start_step = trainer.global_step
            if rank == 0:
                Path(args.out, f"start-{args.launch}.json").write_text(json.dumps({"step": trainer.global_step}))

        def on_train_batch_start(self, trainer: L.Trainer, *a: Any) -> None:
            self._maybe(trainer, "batch_start")

        def on_before_optimizer_step(self, trainer: L.Trainer, *a: Any) -> None:
            self._maybe(trainer, "step")

        def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            if rank == 0 and trainer.state.fn == "fit":
                with open(Path(args.out, f"validations-{args.launch}.txt"), "a") as f:
                    f.write(f"{trainer.global_step}\n")

        def on_train_batch_end(self, trainer: L.Trainer, *a: Any) -> None:
            if args.sigterm is not None and trainer.global_step == args.sigterm and local_rank == 1:
                os.kill(os.getppid(), signal.SIGTERM)  # the launcher (rank 0's process) is told to stop

    chaos = Chaos()
    if fault and fault[0] in _SAVE_POINTS and rank == fault[2]:

        def hook(point: str) -> None:
            if point == fault[0] and trainer.global_step == fault[1]:
                _kill_job()

        checkpointing.fault_hook = hook

    L.seed_everything(0, verbose=False)
    setting = by_name(args.setting)
    model = setting.model()
    extra = setting.trainer_kwargs()
    strategy = extra.get("strategy")
    callbacks = extra.setdefault("callbacks", [])
    if not isinstance(strategy, FaultTolerantStrategyMixin):
        callbacks.append(FaultTolerance(step_seeded_rng=True))
    callbacks += [chaos, ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.every, save_last=True)]
    from tests.test_settings_integration import _COMMON, _flat_state

    common = {**_COMMON, "devices": args.devices, "num_nodes": setting.num_nodes}
    validation = {"val_check_interval": args.val_every, "limit_val_batches": 2} if args.val_every else {}
    if args.csv_log:  # every launch continues the same version folder
        from lightning.pytorch.loggers import CSVLogger

        common.update(logger=CSVLogger(args.out, name="logs", version=0, flush_logs_every_n_steps=1),
                      log_every_n_steps=1)  # fmt: skip
    trainer = L.Trainer(max_epochs=args.epochs, **{"limit_val_batches": 0, **validation}, **common, **extra)
    trainer.fit(model, datamodule=setting.data(), ckpt_path="last")

    state = _flat_state(model)
    torch.save({"state": state, "step": trainer.global_step}, Path(args.out, f"final-{args.launch}-rank{rank}.pt"))
    _end_job()
    return 0


def _end_job() -> None:
    """End as torch asks a training script to (its "Shutdown" docs): destroy the process groups at the end of main,
    while everything is alive, rather than at interpreter exit (this package's strategies and ``FaultTolerance`` also
    register that at exit, for scripts that do not)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _data_job(args: argparse.Namespace) -> int:
    """A fit that records which samples each rank trains on, stopped after ``max_steps`` (a checkpoint every
    step), on ``devices`` ranks: the world-size-change test runs it 2 -> 1 -> 2 ranks within one epoch."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_bigtrain.callbacks import FaultTolerance

    class Seen(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            with open(Path(args.out, f"seen-{args.launch}-rank{self.global_rank}.txt"), "a") as f:
                f.write(f"{self.current_epoch} {' '.join(str(int(i)) for i in batch)}\n")
            return self.layer(batch.float()[:, None]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            if args.streaming:  # the sample ids as shards: Lightning's sampler becomes a StreamingSampler
                from lightning_bigtrain.data import StreamingDataset

                return DataLoader(StreamingDataset(args.streaming, cache_limit="1MiB", shuffle_window=2),
                                  batch_size=4, shuffle=True, num_workers=2)  # fmt: skip
            return DataLoader(list(range(args.samples)), batch_size=4, shuffle=True)

    class KillAt(L.Callback):
        def on_train_batch_start(self, trainer: L.Trainer, *a: Any) -> None:
            if trainer.global_step == args.kill_at:  # the checkpoint of the step before is committed
                _kill_job()

    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.epochs, max_steps=args.max_steps,
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[FaultTolerance(), ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=1, save_last=True),
                   KillAt()],
    )  # fmt: skip
    trainer.fit(Seen(), ckpt_path="last")
    _end_job()
    return 0


def seen_samples(workdir: Path) -> dict[int, list[int]]:
    """Samples trained on per epoch, over every launch and rank of :func:`_data_job`."""
    seen: dict[int, list[int]] = {}
    for path in sorted(workdir.glob("seen-*.txt")):
        for line in path.read_text().splitlines():
            epoch, *indices = map(int, line.split())
            seen.setdefault(epoch, []).extend(indices)
    return seen


# ---- the harness (runs in the test process) -----------------------------------------------------------------
def launch(setting: str, workdir: Path, launch_id: str, **kwargs: Any) -> int:
    """:func:`_launch`, started again (on a new port) when its rendezvous found the port taken: a multi-"node" job
    meets at a port the harness picked free, which a concurrent test (another pytest worker) may bind before the job
    does ("EADDRINUSE"). Nothing of the job ran then: no rank got past ``init_process_group``."""
    for _ in range(3):
        status = _launch(setting, workdir, launch_id, **kwargs)
        logs = [workdir / f"log-{launch_id}.txt", *workdir.glob(f"log-{launch_id}-node*.txt")]
        if status == 0 or not any("EADDRINUSE" in path.read_text(errors="replace") for path in logs if path.exists()):
            return status
    return status


def _launch(
    setting: str,
    workdir: Path,
    launch_id: str,
    *,
    fault: tuple[str, int, int] | None = None,
    sigterm: int | None = None,
    epochs: int = 3,
    every: int = 2,
    devices: int = 2,
    timeout: float = 600,
    extra: tuple[str, ...] = (),
    kill_after: float | None = None,
    nodes: int = 1,
    val_every: int | None = None,
    csv_log: bool = False,
) -> int:
    """One job; returns its status (``-9`` when a fault killed it). ``kill_after``: SIGKILL the whole job after
    that many seconds (a kill at a random moment), unless it finished before. ``nodes``: the job starts one process per
    "node" on this host (:func:`_nodes`; they meet at a free local port), all in the job's process group.
    ``val_every``: validate (2 batches) every that many training batches; rank 0 records the global step of each
    validation in ``validations-<launch>.txt``."""
    cmd = [sys.executable, "-m", "tests.helpers.chaos", *extra, "--setting", setting, "--out", str(workdir),
           "--ckpt-dir", str(workdir / "ckpt"), "--launch", launch_id, "--epochs", str(epochs),
           "--every", str(every), "--devices", str(devices)]  # fmt: skip
    if fault is not None:
        cmd += ["--fault", "@".join(map(str, fault))]
    if sigterm is not None:
        cmd += ["--sigterm", str(sigterm)]
    if val_every is not None:
        cmd += ["--val-every", str(val_every)]
    if csv_log:
        cmd += ["--csv-log"]
    # A job is launched as a scheduler launches one: no rendezvous variables inherited from the test process.
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    # PYTHONFAULTHANDLER: a job that aborts (SIGABRT, e.g. at interpreter exit) dumps every Python thread to its log.
    env.update(PYTHONPATH=str(_REPO), PYTHONWARNINGS="ignore", PYTHONFAULTHANDLER="1")
    if nodes > 1:  # the job is a launcher of one process per node (see `_nodes`), meeting at a free local port
        from tests.helpers.distributed import free_port

        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nodes * devices))
        cmd += ["--nodes", str(nodes)]
    with open(workdir / f"log-{launch_id}.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=_REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            if kill_after is not None:
                try:
                    return proc.wait(timeout=kill_after)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(timeout=timeout)
        finally:
            # Nothing of the job may survive it (a rank left behind would hold the port and the files).
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _nodes(argv: list[str], nodes: int, out: str, launch_id: str) -> int:
    """A job of several "nodes" on this host: one process per node (``NODE_RANK``; Lightning starts each node's
    other ranks), all in this process's group, so that a fault's ``killpg`` or the harness's takes every node down.
    Returns 0 when every node ends with 0; when one fails, the others (which would wait for it) are killed and its
    status is returned."""
    procs = []
    for node in range(nodes):
        with open(Path(out, f"log-{launch_id}-node{node}.txt"), "w") as log:
            env = {**os.environ, "NODE_RANK": str(node)}
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.helpers.chaos", *argv], cwd=_REPO, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))  # fmt: skip
    while True:
        codes = [p.poll() for p in procs]
        failed = next((c for c in codes if c), None)
        if failed is not None:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return failed
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def schedule(
    seed: int,
    kills: int,
    total_steps: int,
    every: int,
    steps_per_epoch: int = 3,
    points: tuple[str, ...] = POINTS,
    world: int = 2,
) -> list[tuple[str, int, int]]:
    """Seeded faults at increasing steps: (point, global step, rank of ``world``; save faults on rank 0). Save faults
    fall on checkpoint steps, and at least one fault makes the next job resume from a mid-epoch checkpoint (the seed
    is advanced until one does)."""
    for attempt in range(100):
        rng = random.Random(seed * 100 + attempt)
        faults: list[tuple[str, int, int]] = []
        for step in sorted(rng.sample(range(1, total_steps), kills)):
            point = rng.choice(points)
            if point in _SAVE_POINTS:
                step = max(every, step - step % every)
                if any(f[1] >= step for f in faults):
                    point = "step"
                    step = max(step, *(f[1] + 1 for f in faults))
            rank = 0 if point in _SAVE_POINTS else rng.randrange(world)
            faults.append((point, step, rank))
        resumes = [_resumes_from(f, every) for f in faults]
        if any(r > 0 and r % steps_per_epoch for r in resumes):
            return faults
    raise ValueError(f"no schedule of {kills} faults in {total_steps} steps resumes mid-epoch")


def _resumes_from(fault: tuple[str, int, int], every: int) -> int:
    """The step of ``last.ckpt`` after ``fault`` (the save's first file is committed before ``last.ckpt``)."""
    point, step, _ = fault
    if point in _SAVE_POINTS:
        return step - every
    return step - step % every


def _final(workdir: Path, launch_id: str, world: int = 2) -> list[Any]:
    import torch

    return [torch.load(workdir / f"final-{launch_id}-rank{r}.pt") for r in range(world)]


def run_chaos(
    setting: str,
    workdir: Path,
    *,
    kills: int = 3,
    seed: int = 0,
    epochs: int = 3,
    steps_per_epoch: int = 3,
    every: int = 2,
    faults: list[tuple[str, int, int]] | None = None,
    timed: int = 0,
    val_every: int | None = None,
    csv_log: bool = False,
) -> ChaosResult:
    """Uninterrupted job, then one job per fault, then ``timed`` jobs killed at seeded random moments (a delay
    drawn from 40-95% of the uninterrupted job's wall time: inside start-up, a step, a save or a rename, wherever
    it falls), then a job that finishes; final states compared (and, with ``csv_log``, the jobs' CSV logs)."""
    import torch

    from tests.helpers.settings import by_name

    nodes = by_name(setting).num_nodes
    t0 = time.perf_counter()
    ref_dir = workdir / "reference"
    ref_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    started = time.perf_counter()
    if (
        launch(setting, ref_dir, "ref", epochs=epochs, every=every, nodes=nodes, val_every=val_every, csv_log=csv_log)
        != 0
    ):
        raise RuntimeError(f"uninterrupted run of {setting} failed: {(ref_dir / 'log-ref.txt').read_text()[-3000:]}")
    run_dir = workdir / "chaos"
    run_dir.mkdir(parents=True, exist_ok=True)
    wall = time.perf_counter() - started
    faults = (
        faults
        if faults is not None
        else schedule(seed, kills, epochs * steps_per_epoch, every, steps_per_epoch, world=2 * nodes)
    )
    rng = random.Random(seed)
    delays = [round(rng.uniform(0.4, 0.95) * wall, 2) for _ in range(timed)]
    jobs: list[tuple[str, int, int] | float | None] = [*faults, *delays, None]
    rcs, resumed = [], []
    for i, job in enumerate(jobs):
        if isinstance(job, float):
            rc = launch(setting, run_dir, str(i), epochs=epochs, every=every, kill_after=job, nodes=nodes,
                        val_every=val_every, csv_log=csv_log)  # fmt: skip
            if rc != -signal.SIGKILL:
                notes.append(f"the job finished before its kill at {job} s")
        else:
            rc = launch(setting, run_dir, str(i), fault=job, epochs=epochs, every=every, nodes=nodes,
                        val_every=val_every, csv_log=csv_log)  # fmt: skip
            if job is not None and rc != -signal.SIGKILL:
                notes.append(f"fault {job} did not kill the job (status {rc})")
        rcs.append(rc)
        start = run_dir / f"start-{i}.json"
        resumed.append(json.loads(start.read_text())["step"] if start.exists() else -1)
    faults = [*faults, *(("timed", int(d * 1000), -1) for d in delays)]
    if rcs[-1] != 0:
        raise RuntimeError(
            f"final run of {setting} failed: {(run_dir / f'log-{len(jobs) - 1}.txt').read_text()[-3000:]}"
        )
    ref = _final(ref_dir, "ref", 2 * nodes)
    out = _final(run_dir, str(len(jobs) - 1), 2 * nodes)
    pairs = list(zip(ref, out, strict=True))
    identical = all(torch.equal(a["state"], b["state"]) and a["step"] == b["step"] for a, b in pairs)
    diff = max(float((a["state"] - b["state"]).abs().max()) for a, b in pairs)
    mid = sum(1 for s in resumed[1:] if s > 0 and s % steps_per_epoch)
    logs = _csv_log(ref_dir) == _csv_log(run_dir) if csv_log else None
    return ChaosResult(setting, list(faults), rcs, resumed, mid, identical, diff, time.perf_counter() - t0, notes, logs)


def _csv_log(workdir: Path) -> list[dict[str, str]]:
    """A job's CSV log, less ZeroStrategy's memory report (each launch logs its own at its first step)."""
    import csv

    with open(workdir / "logs" / "version_0" / "metrics.csv", newline="") as f:
        return [row for row in csv.DictReader(f) if not any(v and k.startswith("zero/rank0_") for k, v in row.items())]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--setting", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--launch", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--fault", default=None)
    parser.add_argument("--sigterm", type=int, default=None)
    parser.add_argument("--data-job", action="store_true", help="record the samples seen (world-size test)")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--streaming", default=None, help="data job: a StreamingDataset URL of the sample ids")
    parser.add_argument("--kill-at", type=int, default=-1, help="data job: SIGKILL the job at this global step")
    parser.add_argument("--nodes", type=int, default=1, help="launch this many node processes (a row's num_nodes)")
    parser.add_argument("--val-every", type=int, default=None, help="validate every this many training batches")
    parser.add_argument("--csv-log", action="store_true", help="log every step to <out>/logs/version_0/metrics.csv")
    args = parser.parse_args(argv)
    if args.nodes > 1:
        rest = list(sys.argv[1:] if argv is None else argv)
        i = rest.index("--nodes")
        return _nodes(rest[:i] + rest[i + 2 :], args.nodes, args.out, args.launch)
    return _data_job(args) if args.data_job else _job(args)


if __name__ == "__main__":
    sys.exit(main())
