"""ResumableDistributedSampler: DistributedSampler's order, exact continuation, re-partition at another world size."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

from lightning_bigtrain.data.resumable import ResumableDistributedSampler, is_stateful_loader, make_resumable


def _ranks(n: int, world: int, cls: type = ResumableDistributedSampler, **kw) -> list:
    return [cls(list(range(n)), num_replicas=world, rank=r, **kw) for r in range(world)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("n", "world"), [(10, 2), (11, 2), (13, 3), (5, 1)])
def test_same_order_as_distributed_sampler(shuffle, drop_last, n, world):
    ours = _ranks(n, world, shuffle=shuffle, drop_last=drop_last, seed=7)
    torch_ = _ranks(n, world, DistributedSampler, shuffle=shuffle, drop_last=drop_last, seed=7)
    for a, b in zip(ours, torch_):
        a.set_epoch(3)
        b.set_epoch(3)
        assert list(a) == list(b)
        assert len(a) == len(b)


@pytest.mark.parametrize("consumed_per_rank", [0, 4, 8, 12])
def test_resume_at_the_same_world_size_continues_exactly(consumed_per_rank):
    n, world = 27, 2
    reference = _ranks(n, world, seed=1)
    for s in reference:
        s.set_epoch(2)
    for rank, sampler in enumerate(_ranks(n, world, seed=1)):
        cursor = consumed_per_rank * world
        sampler.resume(2, cursor, counted=consumed_per_rank)
        assert len(sampler) == len(reference[rank])  # the loop's epoch length is unchanged
        assert list(sampler) == list(reference[rank])[consumed_per_rank:]
        assert sampler.cursor(consumed_per_rank) == cursor


def _consume(samplers: list, batches: int, batch: int) -> list[int]:
    """Draw ``batches`` batches of ``batch`` from every rank (as lockstep ranks do)."""
    seen = []
    for s in samplers:
        seen += list(s)[: batches * batch]
    return seen


@pytest.mark.parametrize("n", [50, 51, 53])
def test_world_size_2_1_2_sees_every_sample_once(n):
    """2 ranks take 3 batches, 1 rank takes 3 more, 2 ranks finish the epoch: every sample once, duplicates only
    the padding of the last partition (fewer than the world size)."""
    batch, epoch = 4, 5
    first = _ranks(n, 2, seed=3)
    for s in first:
        s.set_epoch(epoch)
    seen = _consume(first, 3, batch)
    cursor = first[0].cursor(3 * batch)
    assert cursor == 24

    (single,) = _ranks(n, 1, seed=3)
    single.resume(epoch, cursor, counted=3 * batch)
    seen += _consume([single], 3, batch)
    cursor = single.cursor(6 * batch)
    assert cursor == 36

    last = _ranks(n, 2, seed=3)
    for s in last:
        s.resume(epoch, cursor, counted=6 * batch)
        assert len(s) == 6 * batch + -(-(n - 36) // 2)
    seen += [i for s in last for i in s]
    counts = Counter(seen)
    assert set(counts) == set(range(n))
    assert sum(counts.values()) - n == (n - 36) % 2  # the padding only


def test_a_new_epoch_after_a_resumed_one_starts_from_its_beginning():
    (s,) = _ranks(12, 1, seed=0)
    s.resume(0, 8, counted=8)
    assert len(list(s)) == 4
    s.set_epoch(1)
    (fresh,) = _ranks(12, 1, seed=0)
    fresh.set_epoch(1)
    assert list(s) == list(fresh) and len(s) == 12


def test_bad_resume_position_is_refused():
    (s,) = _ranks(4, 1)
    with pytest.raises(ValueError, match=r"resume\(cursor=-1"):
        s.resume(0, -1, 0)


def _trainer(processed: int) -> SimpleNamespace:
    """The fit loop's consumed-batch counter, which the loader's state reads (set by hand here)."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress),
                                                    _combined_loader=None), limit_train_batches=1.0)  # fmt: skip


def test_make_resumable_saves_and_restores_the_cursor_of_a_wrapped_user_sampler():
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    data = list(range(40))

    def user() -> RandomSampler:  # each rank's own copy of the user's seeded sampler
        return RandomSampler(data, generator=torch.Generator().manual_seed(5))

    loaders = [DataLoader(data, batch_size=4, sampler=DistributedSamplerWrapper(user(), num_replicas=2, rank=r,
                                                                                seed=0)) for r in range(2)]  # fmt: skip
    trainer = _trainer(0)
    made = [make_resumable(dl, lambda: trainer) for dl in loaders]
    assert all(is_stateful_loader(m) for m in made) and not any(is_stateful_loader(dl) for dl in loaders)
    reference = [[int(x) for b in DataLoader(data, batch_size=4, sampler=DistributedSamplerWrapper(
        user(), num_replicas=2, rank=r, seed=0)) for x in b] for r in range(2)]  # fmt: skip
    assert [[int(x) for b in m for x in b] for m in made] == reference
    trainer.fit_loop.epoch_loop.batch_progress.current.processed = 2
    state = made[0].state_dict()
    assert state["cursor"] == 16 and state["epoch"] == 0
    resumed = make_resumable(DataLoader(data, batch_size=4, sampler=DistributedSamplerWrapper(
        user(), num_replicas=2, rank=1, seed=0)), lambda: trainer)  # fmt: skip
    resumed.load_state_dict(state)
    assert [int(x) for b in resumed for x in b] == reference[1][8:]


def test_a_pass_resumed_inside_and_then_completed_saves_the_end_of_the_pass():
    """A job resumed inside an epoch that then finished the epoch's last batch and saved (a checkpoint at the
    epoch's last step, the fit loop's training loader in a ``CombinedLoader``) wrote the cursor where its resume
    began (16 of 48) instead of the end: a complete pass counted as 0 batches (its count modulo the loader's
    length), so a job resumed from that checkpoint restored a loader 2 batches long where the loop had consumed 3
    (the chaos harness: killed after the commits at steps 6 and 8 of a 3-step epoch, the run ended 4.4e-4 off the
    uninterrupted one, under every strategy). Both the uninterrupted job and the resumed one save the end."""
    from lightning.pytorch.utilities import CombinedLoader

    data = list(range(48))

    def loader(trainer: SimpleNamespace) -> Any:
        made = make_resumable(DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=2, rank=0,
                                                                                         seed=0)), lambda: trainer)  # fmt: skip
        trainer.fit_loop._combined_loader = CombinedLoader([made], "max_size_cycle")
        return made

    uninterrupted = _trainer(3)
    whole = loader(uninterrupted)
    list(whole)  # the epoch's 3 batches
    assert whole.state_dict()["cursor"] == 48
    trainer = _trainer(1)  # a job resumed after the epoch's first batch (8 samples per rank: cursor 16)
    resumed = loader(trainer)
    resumed.load_state_dict({**whole.state_dict(), "cursor": 16})
    assert len(resumed) == 3 and len(list(resumed)) == 2  # the loop's epoch length; the 2 batches left
    trainer.fit_loop.epoch_loop.batch_progress.current.processed = 3  # it finished the epoch and saves
    state = resumed.state_dict()
    assert state["cursor"] == 48, state
    again = loader(_trainer(3))
    again.load_state_dict(state)
    assert len(again) == 3 and list(again) == []  # as long as the loop counted; nothing left of the epoch


def test_a_one_process_plain_or_shuffled_loader_resumes_mid_epoch():
    """No distributed sampler injected (one process): a SequentialSampler keeps its order, a RandomSampler
    becomes a seeded shuffle; both continue mid-epoch, and a resumed process takes the checkpoint's seed."""
    from lightning_bigtrain.warnings import NoEffectWarning

    data = list(range(20))
    trainer = _trainer(0)
    plain = make_resumable(DataLoader(data, batch_size=4), lambda: trainer)
    assert is_stateful_loader(plain) and [int(x) for b in plain for x in b] == data
    torch.manual_seed(7)
    shuffled = make_resumable(DataLoader(data, batch_size=4, shuffle=True), lambda: trainer)
    order = [int(x) for b in shuffled for x in b]
    assert sorted(order) == data and order != data
    trainer.fit_loop.epoch_loop.batch_progress.current.processed = 2
    state = shuffled.state_dict()
    torch.manual_seed(99)  # the resumed process was not seeded alike
    resumed = make_resumable(DataLoader(data, batch_size=4, shuffle=True), lambda: trainer)
    resumed.load_state_dict(state)
    assert [int(x) for b in resumed for x in b] == order[8:]
    with_replacement = DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True))
    with pytest.warns(NoEffectWarning, match="draws with replacement"):
        assert make_resumable(with_replacement, lambda: trainer) is with_replacement


def test_a_stateful_loader_is_left_alone():
    data = list(range(8))
    from torchdata.stateful_dataloader import StatefulDataLoader

    stateful = StatefulDataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert make_resumable(stateful, lambda: None) is stateful


def test_a_state_for_another_dataset_is_refused():
    data = list(range(20))
    trainer = _trainer(1)
    loader = make_resumable(DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 0)), lambda: trainer)
    state = loader.state_dict()
    other = make_resumable(DataLoader(data[:10], batch_size=2, sampler=DistributedSampler(data[:10], 2, 0)),
                           lambda: trainer)  # fmt: skip
    with pytest.raises(ValueError, match="dataset of 20 samples"):
        other.load_state_dict(state)


def test_a_loader_that_cannot_be_made_resumable_warns():
    from lightning_bigtrain.warnings import NoEffectWarning

    class OwnSampler(DistributedSampler):
        pass

    data = list(range(8))
    own = DataLoader(data, batch_size=2, sampler=OwnSampler(data, num_replicas=2, rank=0))
    with pytest.warns(NoEffectWarning, match=r"its sampler is the user's OwnSampler"):
        assert make_resumable(own, lambda: None) is own
    batches = torch.utils.data.BatchSampler(DistributedSampler(data, 2, 0), batch_size=2, drop_last=False)
    custom = DataLoader(data, batch_sampler=batches)
    with pytest.warns(NoEffectWarning, match=r"custom BatchSampler"):
        assert make_resumable(custom, lambda: None) is custom


class _TwoSources(L.LightningModule):
    """Trains on a ``CombinedLoader`` of two shuffled sources, one shorter (Lightning's multi-source training)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        torch.manual_seed(0)
        self.net = torch.nn.Linear(16, 4)

    def training_step(self, batch, batch_idx):
        parts = [part for part in batch.values() if part is not None]  # "max_size": the shorter one ran out
        return sum(torch.nn.functional.cross_entropy(self.net(x), y) for x, y in parts)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self):
        from lightning.pytorch.utilities import CombinedLoader

        g = torch.Generator().manual_seed(1)
        long = TensorDataset(torch.randn(128, 16, generator=g), torch.randint(0, 4, (128,), generator=g))
        short = TensorDataset(torch.randn(48, 16, generator=g), torch.randint(0, 4, (48,), generator=g))
        loaders = {"long": DataLoader(long, batch_size=8, shuffle=True), "short": DataLoader(short, batch_size=8,
                                                                                              shuffle=True)}  # fmt: skip
        return CombinedLoader(loaders, self.mode)


def _two_sources(rank: int, root: str, name: str, mode: str) -> list[torch.Tensor]:
    """Uninterrupted, and stopped after step 5 and resumed from that checkpoint, both to step 12. Per rank an epoch
    is the long source's 8 batches; the short source has 3, so step 5 is in its second pass (or after its end)."""
    import os

    import lightning_bigtrain as bt
    from lightning_bigtrain.strategies import ZeroStrategy

    def trainer(max_steps: int, callbacks: list) -> L.Trainer:
        ddp = name == "ddp"
        return L.Trainer(accelerator="cpu", devices=2, strategy="ddp" if ddp else ZeroStrategy(stage=1),
                         max_steps=max_steps, callbacks=([bt.callbacks.FaultTolerance()] if ddp else []) + callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(callbacks))  # fmt: skip

    whole = _TwoSources(mode)
    trainer(12, []).fit(whole)
    folder = os.path.join(root, f"{name}-{mode}")
    trainer(5, [ModelCheckpoint(dirpath=folder, every_n_train_steps=5)]).fit(_TwoSources(mode))
    resumed = _TwoSources(mode)
    trainer(12, []).fit(resumed, ckpt_path=os.path.join(folder, "epoch=0-step=5.ckpt"))
    return [torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters(), strict=True)]


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["max_size_cycle", "max_size"])
def test_several_training_sources_resume_exactly_mid_epoch(tmp_path, mode):
    """A ``CombinedLoader``'s shorter loader starts its order again when it runs out ("max_size_cycle", Lightning's
    default) or stops ("max_size"); its position was taken as the epoch's batch count, past its end, and the resumed
    run trained on other batches than the uninterrupted one (weights 0.026 apart), silently."""
    from tests.helpers.distributed import run_on_ranks

    for name in ("ddp", "zero1"):
        for same in run_on_ranks(_two_sources, str(tmp_path), name, mode, init_process_group=False):
            assert all(same), (name, mode)
