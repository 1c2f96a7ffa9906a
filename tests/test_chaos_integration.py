"""Crash consistency end to end: jobs killed with SIGKILL at seeded fault points (mid-step, mid-save before and
after the commit) and relaunched with ``ckpt_path="last"`` end bit-identical to the uninterrupted run;
SIGTERM writes a checkpoint and exits with status 75; a mid-epoch resume at world size 2 -> 1 -> 2 sees every
sample of the epoch once. The whole settings matrix runs in ``benchmarks/chaos.py``."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest

from lightning_bigtrain.callbacks import EXIT_PREEMPTED
from tests.helpers.chaos import _final, launch, run_chaos, seen_samples

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("setting", "seed"),
    [("ddp_cnn", 1), ("zero3_gpt", 3)],  # Lightning's DDP + FaultTolerance; ZeRO-3 (FSDP2 folders) with dropout
)
def test_killed_and_resumed_runs_end_bit_identical(setting, seed, tmp_path):
    # Two seeded kills per row; seeds 1 and 3 put them at all four points between them (step and
    # save_after_commit; batch_start and save_before_commit). The whole matrix is benchmarks/chaos.py's.
    result = run_chaos(setting, tmp_path, kills=2, seed=seed)
    assert not result.notes, result.notes  # every fault fired: each job was killed where it was meant to be
    assert result.kills_survived == 2
    assert result.mid_epoch_resumes >= 1, result.resumed_from
    assert result.identical, f"max |difference| {result.max_abs_diff}"


def test_a_run_resumed_twice_at_and_after_an_epoch_end_ends_bit_identical(tmp_path):
    """Killed right after the commit at step 6 (the last of its 3-step epoch, while the last checkpoint is step
    4's), then right after the commit at step 8. The second job resumed inside epoch 2, finished it and saved step 6
    with its data cursor where its resume began (a complete pass counted as none), so the third job restored a loader
    2 batches long where the loop had consumed 3, and the run ended 4.4e-4 off the uninterrupted one (under DDP,
    ZeRO-1 and ZeRO-3 alike; the seeded matrix had not drawn these two faults together)."""
    result = run_chaos("ddp_gpt", tmp_path, faults=[("save_after_commit", 6, 0), ("save_after_commit", 8, 0)])
    assert result.kills_survived == 2 and not result.notes, result.notes
    assert result.identical, f"max |difference| {result.max_abs_diff}"


def test_a_validation_due_after_a_step_checkpoint_runs_again_after_the_kill(tmp_path):
    """Validation every 2 of each epoch's 3 batches (after steps 2, 5, 8) and a checkpoint every 2 steps, on 2 ranks
    under ZeroStrategy. Killed right after the commit of step 4's first file (``last`` still names step 2's), then
    inside step 9: each relaunch resumes from a checkpoint written before the validation due after it (steps 2 and
    8), and runs that validation first. Lightning alone resumed past them (the validations of the relaunches were
    [5, 8] and [], the plateau step or early-stopping count they feed lost); the run ends bit-identical."""
    result = run_chaos("zero1_gpt", tmp_path, faults=[("save_after_commit", 4, 0), ("step", 8, 1)], val_every=2,
                       csv_log=True)  # fmt: skip
    assert result.kills_survived == 2 and not result.notes, result.notes
    assert result.resumed_from == [0, 2, 8], result.resumed_from

    def validations(folder: Path, launch_id: str) -> list[int]:
        path = folder / f"validations-{launch_id}.txt"
        return [int(line) for line in path.read_text().split()] if path.exists() else []

    assert validations(tmp_path / "reference", "ref") == [2, 5, 8]
    assert [validations(tmp_path / "chaos", str(i)) for i in range(3)] == [[2], [2, 5, 8], [8]]
    assert result.identical, f"max |difference| {result.max_abs_diff}"
    # Every launch logs to the same version folder; the rows logged after each kill's checkpoint (the training
    # steps, and the validation at step 8 the relaunch runs again) are the relaunch's: the log is the reference's.
    assert result.logs_identical


def test_a_job_of_two_nodes_is_killed_whole_by_a_fault_on_the_second_node(tmp_path):
    """2 "nodes" x 2 ranks (the hierarchical compressed exchange): a fault inside a step on global rank 2, which
    lives in node 1's process tree, takes node 0 down too, and the relaunch ends bit-identical on all 4 ranks."""
    result = run_chaos("ddp_hier_powersgd_gpt", tmp_path, faults=[("step", 4, 2)])
    assert result.returncodes == [-signal.SIGKILL, 0], result.returncodes
    assert result.resumed_from[1] == 4 and result.mid_epoch_resumes == 1  # 3 steps per epoch: step 4 is mid-epoch
    for node in (0, 1):
        log = (tmp_path / "chaos" / f"log-0-node{node}.txt").read_text()
        assert "Traceback" not in log, log[-2000:]
    assert len(list((tmp_path / "chaos").glob("final-1-rank*.pt"))) == 4
    assert result.identical, f"max |difference| {result.max_abs_diff}"


def test_sigterm_checkpoints_exits_75_and_the_relaunch_continues_exactly(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    assert launch("zero2_cnn", ref, "ref") == 0
    assert launch("zero2_cnn", run, "0", sigterm=4) == EXIT_PREEMPTED == 75
    assert (run / "ckpt" / "last.ckpt").exists()
    assert launch("zero2_cnn", run, "1") == 0
    # Checkpointed at the end of the batch during which the launcher noticed the signal (step 4 or 5: the signal
    # races the batch-end check): mid-epoch either way (3 steps per epoch).
    resumed = json.loads((run / "start-1.json").read_text())["step"]
    assert resumed in (4, 5), resumed
    import torch

    for a, b in zip(_final(ref, "ref"), _final(run, "1"), strict=True):
        assert torch.equal(a["state"], b["state"])


@pytest.mark.parametrize("samples", [51])  # not a multiple of 2 or of the batch: padding at both world sizes
def test_world_size_2_1_2_mid_epoch_sees_every_sample_once(samples, tmp_path):
    common = ("--data-job", "--samples", str(samples))
    assert launch("-", tmp_path, "a", devices=2, epochs=1, extra=(*common, "--max-steps", "2")) == 0  # 16 samples
    assert launch("-", tmp_path, "b", devices=1, epochs=1, extra=(*common, "--max-steps", "5")) == 0  # 12 more
    assert launch("-", tmp_path, "c", devices=2, epochs=1, extra=common) == 0  # the rest of the epoch
    seen = seen_samples(tmp_path)
    assert list(seen) == [0]
    counts = Counter(seen[0])
    assert set(counts) == set(range(samples)), "samples of the epoch were skipped"
    assert sum(counts.values()) - samples == (samples - 28) % 2  # repeats: the last partition's padding only


def test_killed_mid_epoch_while_streaming_from_s3_and_resumed_on_one_rank_sees_every_sample_once(
    s3_bucket, tmp_path, monkeypatch
):
    """2 ranks stream the sample ids from a real S3 server (2 loader workers each, a cache that holds a few
    shards), the job is SIGKILLed at step 3 (mid-epoch), one rank resumes from the last checkpoint and
    finishes the epoch: every sample of it is trained on exactly once."""
    from lightning_bigtrain.data import write_shards

    _, bucket = s3_bucket
    samples = 51
    url = f"s3://{bucket}/ids"
    write_shards(list(range(samples)), url, shard_bytes=48)  # 6 ids a shard: 9 shards
    monkeypatch.setenv("BIGTRAIN_CACHE", str(tmp_path / "cache"))
    common = ("--data-job", "--samples", str(samples), "--streaming", url)
    assert launch("-", tmp_path, "a", devices=2, epochs=1, extra=(*common, "--kill-at", "3")) == -signal.SIGKILL
    assert launch("-", tmp_path, "b", devices=1, epochs=1, extra=common) == 0
    seen = seen_samples(tmp_path)
    assert list(seen) == [0]
    assert len(seen[0]) == samples and sorted(seen[0]) == list(range(samples))  # none skipped, none repeated
    assert list((tmp_path / "cache").rglob("*.pt")), "the shards were not read through the cache"


def test_a_relaunch_after_the_last_step_exits_at_once(tmp_path):
    """A job whose last checkpoint is its last batch (3 steps per epoch, saved every 3), relaunched as a scheduler
    would after the job was killed on its way out: the fit loop restores, finds the run done and exits 0 (it failed in
    teardown: the fetcher that `load_pending_states` tore down was torn down again)."""
    assert launch("ddp_cnn", tmp_path, "0", every=3) == 0
    assert launch("ddp_cnn", tmp_path, "1", every=3) == 0
    assert json.loads((tmp_path / "start-1.json").read_text())["step"] == 9


def test_a_save_after_the_last_step_does_not_change_the_replicas_buffers(tmp_path):
    """Killed before the last step, the relaunch trains that one step and, as Lightning does for a process that has
    saved no `last` checkpoint yet, saves one at train end. ZeRO's state dict carries rank 0's BatchNorm statistics
    (DCP keeps one copy of replicated tensors); it broadcast them into the module, so rank 1 ended on rank 0's
    statistics, not its own as in the uninterrupted run (found by the chaos matrix's timed kill: 0.0066 off). Then
    one more relaunch, from that train-end checkpoint (nothing left to train): it loads rank 0's statistics on every
    rank, so every run now ends on rank 0's (the strategies broadcast them at train end; DeepSpeed's row failed so)."""
    result = run_chaos("zero2_cnn", tmp_path, faults=[("batch_start", 8, 0)])
    assert result.resumed_from[-1] == 8 and not result.notes, (result.resumed_from, result.notes)
    assert result.identical, f"max |difference| {result.max_abs_diff}"
    run = tmp_path / "chaos"
    assert launch("zero2_cnn", run, "again") == 0  # the fit loop finds the run done (no train start or end)
    ref, again = _final(tmp_path / "reference", "ref"), _final(run, "again")
    assert all(a["state"].equal(b["state"]) for a, b in zip(ref, again, strict=True))


def test_a_run_resumed_after_the_last_pruning_event_saves_the_pruned_shapes(tmp_path):
    """StructuredPruning removes channels at steps 1, 3 and 4. A job resumed at step 6 prunes nothing more; the
    checkpoint it writes at step 8 must still say which shapes the model has, or the next relaunch cannot load it
    ("size mismatch ... torch.Size([8]) from checkpoint, ... torch.Size([16])": found by the chaos matrix)."""
    result = run_chaos("structured_ddp_cnn", tmp_path, faults=[("batch_start", 7, 0), ("step", 8, 0)])
    assert result.resumed_from[1:] == [6, 8] and not result.notes, (result.resumed_from, result.notes)
    assert result.identical, f"max |difference| {result.max_abs_diff}"
