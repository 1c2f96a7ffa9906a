"""Exact mid-epoch resume for the training dataloaders Lightning builds.

The position in the epoch is kept in the sampler as a **global sample cursor**: the number of samples of the
epoch's (shuffled, padded) index list that all ranks together have consumed, with the shuffle seed and epoch.
Because the cursor is global, it can be re-partitioned when the run resumes at another world size: the
remaining indices are dealt out to the new ranks the way :class:`~torch.utils.data.DistributedSampler` deals
them, so no sample of the epoch is skipped and none is repeated (beyond the sampler's padding).

At the same world size the resumed ranks draw exactly the indices the uninterrupted run would have drawn:
the index list is :class:`~torch.utils.data.DistributedSampler`'s own (same seed, epoch and padding), and
rank ``r`` takes every ``world_size``-th index from the cursor on.

:func:`make_resumable` swaps the sampler Lightning injected for a :class:`ResumableDistributedSampler` with the
same settings and gives the dataloader instance ``state_dict``/``load_state_dict``, which Lightning's fit loop
saves in checkpoints and restores before it iterates. The number of batches consumed comes from the fit
loop's own progress counter (``batch_progress.current.processed``, the count Lightning restores), not from the
iterator, which worker processes and prefetching run ahead of. Map-style datasets need no worker state:
indices come from the main process, so ``num_workers > 0`` resumes exactly as long as the dataset's
``__getitem__`` is deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, SequentialSampler

__all__ = [
    "STATE_VERSION",
    "ResumableDistributedSampler",
    "is_stateful_loader",
    "load_pending_states",
    "make_resumable",
]

STATE_VERSION = 1


class ResumableDistributedSampler(DistributedSampler):
    """:class:`~torch.utils.data.DistributedSampler` with a global, re-partitionable position in the epoch.

    Without a resume position it yields exactly what ``DistributedSampler`` yields. After
    :meth:`resume` it yields, for the one epoch it was resumed in, only the indices not yet consumed,
    dealt out to this rank as ``remaining[rank::num_replicas]`` (padded to equal length per rank);
    ``len()`` still counts the epoch's batches that were consumed before the resume (``counted``), so the
    dataloader's length is the number of batches the fit loop expects in the whole epoch.

    Args:
        dataset: A sized dataset (or Lightning's wrapper of a user's sampler).
        num_replicas: World size.
        rank: This rank.
        shuffle: Shuffle with ``seed + epoch`` (as ``DistributedSampler``).
        seed: Shuffle seed, the same on every rank.
        drop_last: Drop the tail instead of padding (as ``DistributedSampler``).
        index_map: Maps an index of the distributed list to the dataset index (used when wrapping a
            user's sampler, whose output list is indexed).
    """

    #: What the epoch's index list is a permutation of, saved with the position: ``"samples"`` (this order, the
    #: same at every world size) or a subclass's (e.g. ``"shards"``, which depends on the world size).
    order = "samples"

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        index_map: Callable[[], Callable[[int], Any]] | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)  # fmt: skip
        self._index_map = index_map
        self.order_world_size: int | None = None  # the world size the resumed epoch's list was made for
        self._resume: tuple[int, int] | None = None  # (cursor, counted samples) for the epoch resumed in
        self._active: tuple[int, int] = (0, 0)  # the same for the iteration in progress

    # ---- the index list --------------------------------------------------------------------------------
    def _epoch_indices(self) -> list[int]:
        """This epoch's index list, before padding (DistributedSampler's order)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=g).tolist()  # type: ignore[arg-type]
        return list(range(len(self.dataset)))  # type: ignore[arg-type]

    def _partition(self, indices: list[int], start: int, multiple: int) -> list[int]:
        """``indices[start:]`` made a multiple of ``multiple`` long as DistributedSampler makes its list: cut
        (``drop_last``) or padded with indices from the start of the epoch's list."""
        rest = indices[start:]
        if self.drop_last:
            return rest[: len(rest) - len(rest) % multiple]
        padding = (-len(rest)) % multiple
        while padding > 0:
            take = indices[: min(padding, len(indices))]
            rest = rest + take
            padding -= len(take)
        return rest

    def _remaining(self, cursor: int) -> list[int]:
        """The indices not consumed yet, for this world size. At the world size the cursor was counted at,
        this is DistributedSampler's padded list from ``cursor`` on (``cursor`` is a multiple of it)."""
        indices = self._epoch_indices()
        if cursor >= len(indices):  # only the padding of a previous world size was left: the epoch is done
            return []
        return self._partition(indices, cursor, self.num_replicas)

    # ---- Sampler interface -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        cursor, counted = self._resume if self._resume is not None else (0, 0)
        self._resume = None
        self._active = (cursor, counted)
        own = self._remaining(cursor)[self.rank :: self.num_replicas]
        if self._index_map is not None:
            lookup = self._index_map()
            return iter([lookup(i) for i in own])
        return iter(own)

    def __len__(self) -> int:
        if self._resume is None:
            return self.num_samples
        cursor, counted = self._resume
        return counted + len(self._remaining(cursor)) // self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        if self._resume is not None and epoch != self.epoch:
            self._resume = None  # a new epoch starts from its beginning
        if epoch != self.epoch:
            self._active = (0, 0)
            self.order_world_size = None  # a new epoch's list is made for this run's world size
        super().set_epoch(epoch)

    def list_world_size(self) -> int:
        """The world size the current epoch's list was made for (the cursor counts positions in it)."""
        return self.order_world_size or self.num_replicas

    # ---- position --------------------------------------------------------------------------------------
    def cursor(self, samples_per_rank: int) -> int:
        """The global cursor after this rank consumed ``samples_per_rank`` samples of the current epoch
        (counted from the epoch's start, as the fit loop counts them)."""
        start, counted = self._active
        return start + max(samples_per_rank - counted, 0) * self.num_replicas

    def resume(self, epoch: int, cursor: int, counted: int) -> None:
        """Continue ``epoch`` after ``cursor`` samples consumed globally; ``counted`` samples of this rank are
        already counted by the fit loop (the epoch's length stays the loop's)."""
        if cursor < 0 or counted < 0:
            raise ValueError(f"ResumableDistributedSampler.resume(cursor={cursor}, counted={counted}): must be >= 0.")
        self.epoch = epoch
        self._resume = (cursor, counted)


def is_stateful_loader(loader: object) -> bool:
    """Whether Lightning's fit loop saves and restores ``loader``'s position (the ``_Stateful`` protocol)."""
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def _batches_consumed(trainer: Any) -> int:
    """Training batches of the current epoch the fit loop has processed (the count it restores on resume)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def _pass_batches(trainer: Any, loader: object) -> int:
    """Batches of ``loader``'s current pass the fit loop has consumed: the epoch's count, except for a loader of
    several in a ``CombinedLoader`` that runs out before the epoch ends: in ``"max_size_cycle"`` (Lightning's
    default for training) a shorter loader starts again from the beginning of its order each time it runs out, in
    ``"max_size"`` it stops. Counted from the epoch's count, its count modulo the loader's length (a resumed pass is
    a whole one: its length counts the batches consumed before the checkpoint), or capped by it. A pass that has
    just ended counts whole: its cursor is the end of the pass, not the start of the next one (the start would,
    after a resume inside that pass, leave the cursor where the resume began, and the loader restored from it would
    count fewer batches in the epoch than the fit loop had consumed)."""
    from lightning_bigtrain._compat import combined_mode, fit_combined_loader

    processed = _batches_consumed(trainer)
    combined = fit_combined_loader(trainer)
    if combined is None or not any(candidate is loader for candidate in combined.flattened):
        return processed
    length = len(loader)  # type: ignore[arg-type]
    mode = combined_mode(combined)
    if mode == "max_size_cycle" and length > 0:
        return (processed - 1) % length + 1 if processed > 0 else 0
    if mode == "max_size":
        return min(processed, length)
    return processed


def make_resumable(dataloader: object, trainer_ref: Callable[[], Any]) -> object:
    """Make a dataloader Lightning built resume exactly mid-epoch, in place where possible.

    A ``DataLoader`` whose sampler is Lightning's injected ``DistributedSampler`` (or its wrapper of a
    user's sampler) is rebuilt with a :class:`ResumableDistributedSampler` carrying the same settings and
    given ``state_dict``/``load_state_dict``. Loaders that are stateful already (torchdata's
    ``StatefulDataLoader``, a user's own) and anything else are returned unchanged.

    Args:
        dataloader: What ``train_dataloader()`` returned, after Lightning's sampler injection.
        trainer_ref: Returns the trainer (its fit loop counts the consumed batches).

    Returns:
        The dataloader to use.
    """
    if not isinstance(dataloader, DataLoader) or is_stateful_loader(dataloader):
        return dataloader
    if dataloader.batch_size is None and isinstance(getattr(dataloader.batch_sampler, "sampler", None),
                                                    DistributedSampler):  # fmt: skip
        _not_resumable(f"it batches with a custom {type(dataloader.batch_sampler).__name__}")
        return dataloader
    sampler = dataloader.sampler
    if dataloader.batch_size is not None and _is_streaming_sampler(sampler):
        streaming: Any = sampler
        return _with_state(dataloader, streaming, streaming.dataset, trainer_ref, adopt_seed=False)
    adopt_seed = False  # the shuffle seed is ours (a RandomSampler's stand-in): a resumed run takes the checkpoint's
    if type(sampler) in (SequentialSampler, RandomSampler) and dataloader.batch_size is not None:
        stand_in = _single_process_sampler(sampler, trainer_ref())
        if stand_in is None:
            return dataloader
        sampler, adopt_seed = stand_in, type(sampler) is RandomSampler
    if type(sampler) is not DistributedSampler and not _is_sampler_wrapper(sampler):
        if isinstance(sampler, DistributedSampler):  # a subclass of the user's: its order is its own
            _not_resumable(f"its sampler is the user's {type(sampler).__name__}")
        return dataloader
    if dataloader.batch_size is None:  # a custom batch sampler: its batches may not be fixed-size
        return dataloader
    assert isinstance(sampler, DistributedSampler)
    index_map = None
    dataset: Any = sampler.dataset
    if _is_sampler_wrapper(sampler):
        wrapped: Any = sampler.dataset  # Lightning's _DatasetSamplerWrapper over the user's sampler

        def index_map() -> Callable[[int], Any]:
            wrapped.reset()
            return wrapped.__getitem__

    resumable: ResumableDistributedSampler
    if _is_streaming(dataset):  # Lightning's sampler over a StreamingDataset: read it shard by shard
        from lightning_bigtrain.data.streaming import StreamingSampler

        resumable = StreamingSampler(dataset, num_replicas=sampler.num_replicas, rank=sampler.rank,
                                     shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last)  # fmt: skip
    else:
        resumable = ResumableDistributedSampler(
            dataset,
            num_replicas=sampler.num_replicas,
            rank=sampler.rank,
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
            index_map=index_map,
        )
    from lightning_bigtrain._compat import _update_dataloader

    return _with_state(_update_dataloader(dataloader, resumable), resumable, dataset, trainer_ref, adopt_seed)


def _with_state(
    loader: Any,
    resumable: ResumableDistributedSampler,
    dataset: Any,
    trainer_ref: Callable[[], Any],
    adopt_seed: bool,
) -> Any:
    """``loader`` (whose sampler is ``resumable``) given the ``state_dict``/``load_state_dict`` Lightning's fit
    loop saves and restores."""
    batch_size = int(loader.batch_size)

    def state_dict() -> dict[str, Any]:
        samples = _pass_batches(trainer_ref(), loader) * batch_size
        return {
            "version": STATE_VERSION,
            "epoch": resumable.epoch,
            "seed": resumable.seed,
            "shuffle": resumable.shuffle,
            "num_samples": len(dataset),
            "cursor": resumable.cursor(samples),
            "world_size": resumable.num_replicas,
            "batch_size": batch_size,
            # What the list is a permutation of, and the world size it was made for: the cursor counts positions in it.
            "order": resumable.order,
            "order_world_size": resumable.list_world_size(),
        }

    def load_state_dict(state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"A training dataloader state of version {state.get('version')!r} cannot be loaded "
                             f"(this lightning_bigtrain writes version {STATE_VERSION}).")  # fmt: skip
        if state.get("order", "samples") != resumable.order:
            raise ValueError(
                f"The checkpoint's training data position counts {state.get('order', 'samples')} (a "
                f"{'streaming' if state.get('order') == 'shards' else 'map-style'} dataset's order); this run's loader "
                f"counts {resumable.order}. Resume with the same kind of dataset, or start a new run."
            )
        if bool(state.get("shuffle", resumable.shuffle)) != resumable.shuffle:
            raise ValueError(
                f"The checkpoint's training data position is for a {'' if state['shuffle'] else 'un'}shuffled loader; "
                f"this run's is {'' if resumable.shuffle else 'un'}shuffled. Resume with the same `shuffle`, or start "
                "a new run."
            )
        if adopt_seed:
            resumable.seed = int(state["seed"])
        if state["num_samples"] != len(dataset) or state["seed"] != resumable.seed:
            raise ValueError(
                f"The checkpoint's training data position is for a dataset of {state['num_samples']} samples "
                f"shuffled with seed {state['seed']}; this run has {len(dataset)} samples and seed "
                f"{resumable.seed}. Resume with the same dataset and seed (seed_everything), or start a new run."
            )
        trainer = trainer_ref()
        counted = _pass_batches(trainer, loader) * batch_size
        resumable.order_world_size = int(state.get("order_world_size", state["world_size"]))
        resumable.resume(int(state["epoch"]), int(state["cursor"]), counted)
        _refresh_limit(trainer, loader)
        _warn_if_global_batch_changed(state, resumable.num_replicas, batch_size)

    loader.state_dict = state_dict
    loader.load_state_dict = load_state_dict
    loader._bigtrain_resumable = True
    return loader


def _single_process_sampler(sampler: Any, trainer: Any) -> DistributedSampler | None:
    """The ``DistributedSampler`` of one replica that stands in for a plain sampler Lightning left in place (no
    distributed sampler injected: one process, or ``use_distributed_sampler=False``).

    A ``SequentialSampler`` becomes an unshuffled one: the same order. A ``RandomSampler`` (without replacement,
    one pass per epoch) of a one-process run becomes a shuffled one, ``randperm`` seeded with ``seed + epoch``:
    another uniformly random order per epoch, reproducible from the seed, which is drawn from the sampler's own
    generator if it has one, else the run's ``torch.initial_seed()``. ``None`` (left as it is, with a warning) for
    a ``RandomSampler`` with replacement or another length, or of one of several processes (each draws its own
    order, which one seed cannot stand for).
    """
    dataset = sampler.data_source
    if isinstance(sampler, SequentialSampler):
        return DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    if sampler.replacement or sampler._num_samples is not None or int(getattr(trainer, "world_size", 1)) != 1:
        _not_resumable("its RandomSampler draws with replacement, another number of samples, or per process")
        return None
    if sampler.generator is not None:
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=sampler.generator).item())
    else:
        seed = torch.initial_seed()
    return DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed % 2**63)


def load_pending_states(trainer: Any) -> None:
    """Make sure the checkpoint's dataloader states reach the dataloaders (call at ``on_train_start``).

    Lightning restores them when it builds the training dataloaders, after loading the checkpoint. A model
    whose ``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` (an LR schedule over the run)
    makes Lightning build them earlier, before the checkpoint is loaded, and the states are then never
    applied: the epoch would restart from its first batch. The loaders are dropped here so that the fit
    loop builds them again, with the states, before the first batch.
    """
    from lightning_bigtrain._compat import drop_fit_dataloaders

    drop_fit_dataloaders(trainer)


def _not_resumable(why: str) -> None:
    from lightning_bigtrain.warnings import NoEffectWarning, warn_once

    warn_once(
        f"The training dataloader cannot be resumed mid-epoch by lightning_bigtrain: {why}. A checkpoint taken "
        "mid-epoch replays the epoch from its start; give the loader `state_dict`/`load_state_dict` (torchdata's "
        "StatefulDataLoader with StatefulDistributedSampler) or checkpoint at epoch ends.",
        NoEffectWarning,
    )


def _warn_if_global_batch_changed(state: dict[str, Any], world_size: int, batch_size: int) -> None:
    """A run resumed at another global batch (world size x per-rank batch) takes another number of optimizer steps
    per epoch than the one it was planned with: an LR schedule sized in steps (OneCycleLR over
    ``estimated_stepping_batches``) comes back from the checkpoint with the old length and runs past its end."""
    before = int(state.get("world_size", world_size)) * int(state.get("batch_size", batch_size))
    now = world_size * batch_size
    if before == now:
        return
    from lightning_bigtrain.warnings import warn_once

    warn_once(
        f"Resumed with a global batch of {now} samples ({world_size} x {batch_size}) from a checkpoint taken at "
        f"{before} ({state.get('world_size')} x {state.get('batch_size')}): the rest of the epoch takes another "
        "number of optimizer steps, and an LR schedule sized in steps (e.g. OneCycleLR over "
        "trainer.estimated_stepping_batches), restored with its old length, can run past its end. Keep "
        "batch_size x devices the same across a world-size change to keep the steps.",
        UserWarning,
    )


def _refresh_limit(trainer: Any, loader: object) -> None:
    """Lightning counts the epoch's batches before it restores loader states; at another world size the
    resumed epoch has another length, so this loader's limit is counted again."""
    from lightning.pytorch.trainer.states import RunningStage

    from lightning_bigtrain._compat import _parse_num_batches, fit_combined_loader

    combined = fit_combined_loader(trainer)
    if combined is None or combined.limits is None:
        return
    limits = list(combined.limits)
    for i, candidate in enumerate(combined.flattened):
        if candidate is loader:
            limits[i] = _parse_num_batches(RunningStage.TRAINING, len(loader), trainer.limit_train_batches)
    combined.limits = limits


def _is_streaming(dataset: object) -> bool:
    from lightning_bigtrain.data.streaming import StreamingDataset

    return isinstance(dataset, StreamingDataset)


def _is_streaming_sampler(sampler: object) -> bool:
    from lightning_bigtrain.data.streaming import StreamingSampler

    return isinstance(sampler, StreamingSampler)


def _is_sampler_wrapper(sampler: object) -> bool:
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    return type(sampler) is DistributedSamplerWrapper
