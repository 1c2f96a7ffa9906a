"""Every private Lightning internal this package touches, in one place (and the base our strategy mixins
declare to type checkers: Lightning's ``ParallelStrategy``, so that their ``@override`` marks are checked; at
run time it is ``object`` and the strategy class they are mixed into supplies the methods).

Lightning's private names (a leading underscore) may change in any release. Code elsewhere in the package
imports them from here or calls the helpers below, so that a Lightning upgrade breaks this one module, and
``tests/test_package.py`` imports every name here against the installed release. The range of Lightning
releases this is written for is ``install_requires`` in ``setup.cfg`` (upper bound included); CI installs
the newest release in it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.load import _METADATA_FILENAME, _load_distributed_checkpoint
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.utilities.data import _update_dataloader
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy as StrategyMixinBase
else:
    StrategyMixinBase = object

__all__ = [
    "_IS_INTERACTIVE",
    "_METADATA_FILENAME",
    "StrategyMixinBase",
    "_MultiProcessingLauncher",
    "_StrategyRegistry",
    "_SubprocessScriptLauncher",
    "_WorkerOutput",
    "_load_distributed_checkpoint",
    "_optimizers_to_device",
    "_parse_num_batches",
    "_set_num_threads_if_needed",
    "_update_dataloader",
    "average_fp32_masters",
    "combined_mode",
    "csv_writer_keeping_files",
    "drop_fit_dataloaders",
    "epoch_results",
    "fit_combined_loader",
    "forward_redirection",
    "keep_average_fp32_across_swaps",
    "logger_filesystem",
    "logger_version",
    "logger_writer_created",
    "logging_step",
    "metrics_reset_after_this_hook",
    "restore_average_swap",
    "restore_callback_metrics",
    "restore_epoch_results",
    "rewrap_ddp",
    "run_pending_batch_end",
    "saved_callback_metrics",
    "set_logger_version",
    "should_accumulate",
    "swa_from_fp32_masters",
    "update_plateau_schedulers_at_restored_epoch_end",
    "weight_averaging_callbacks",
]


def should_accumulate(trainer: Any) -> bool:
    """Whether the current training batch only accumulates gradients (no optimizer step after it)."""
    return bool(trainer.fit_loop.epoch_loop._should_accumulate())


def run_pending_batch_end(trainer: Any) -> None:
    """Have a fit resumed from a checkpoint written at the end of a training batch first do what the uninterrupted
    run did after that checkpoint, before the batch's iteration ended (call after the checkpoint is restored, before
    training: ``on_train_start``).

    ``ModelCheckpoint(every_n_train_steps=...)`` and a preemption checkpoint are written in ``on_train_batch_end``.
    After it the uninterrupted run ends the batch's iteration: the validation due then (``val_check_interval``, or
    the epoch's end), the ``ReduceLROnPlateau`` updates, and after an epoch's last batch the epoch's end
    (``on_train_epoch_end``, the epoch's plateau updates). Lightning 2.6, resuming from such a checkpoint, skips all
    of it ("fast forward progress counters to end of validation"; after the last batch it counts the epoch as ended)
    and trains the next batch: whatever those feed is lost (a plateau scheduler's step, ``EarlyStopping``'s count, a
    metric-monitoring checkpoint, what the module's validation and epoch-end hooks keep) and the run goes on unlike
    the uninterrupted one. Here the epoch restored after a last batch is not counted as ended, and the first
    iteration of the resumed epoch loop trains nothing: its end runs what was due, as in the uninterrupted run
    (Lightning's own path for a run restarted in the middle of a validation).
    """
    fit_loop = trainer.fit_loop
    loop = fit_loop.epoch_loop
    if not loop.restarted_on_train_batch_end or "advance" in vars(loop):
        return
    if loop.batch_progress.is_last_batch and fit_loop.restarted_mid_epoch:
        # FitLoop.reset counted the epoch as processed and completed: the epoch loop ends it instead.
        for progress in (fit_loop.epoch_progress.current, fit_loop.epoch_progress.total):
            progress.processed -= 1
            progress.completed -= 1
        # What the epoch loop's reset does for this restart, but for its starting the next epoch's counters.
        loop.batch_progress.increment_completed()
        loop.reset_restart_stage()
    original = loop.advance

    def advance(data_fetcher: Any) -> None:
        del loop.advance  # once: the loop's own method from here on
        if loop.restarting and loop.batch_progress.current.completed > 0 and not loop.val_loop.restarted_mid_evaluation:
            loop.val_loop.restarting = False  # a fresh validation, not the previous one's progress
            if not loop._should_accumulate():
                loop._batches_that_stepped -= 1  # counted at the restore and again at this iteration's end
            return
        original(data_fetcher)

    loop.advance = advance


def update_plateau_schedulers_at_restored_epoch_end(trainer: Any) -> None:
    """Let the epoch's ``ReduceLROnPlateau`` schedulers update at the end of the epoch a fit resumed in (call in
    ``on_train_epoch_end``).

    Lightning 2.6 skips them at the end of the first epoch after a restore, because the metrics they monitor are in
    no checkpoint; a run resumed mid-epoch then misses a plateau step the uninterrupted run took. Where every metric
    they monitor was logged in this process (the epoch's validation ran here), they update as in the uninterrupted
    run; otherwise Lightning's skip stands.
    """
    fit_loop = trainer.fit_loop
    if not fit_loop.restarting:
        return
    configs = [c for c in trainer.lr_scheduler_configs if c.reduce_on_plateau and c.interval == "epoch"]
    if configs and all(c.monitor in trainer.callback_metrics for c in configs):
        fit_loop._restarting = False  # this loop's flag only: it ends with this iteration anyway


def saved_callback_metrics(trainer: Any) -> dict[str, Any]:
    """The scalar metrics ``trainer.callback_metrics`` holds (what plateau schedulers and other monitors read),
    detached on the CPU: put into a checkpoint, since Lightning saves none."""
    import torch

    return {
        name: value.detach().cpu().clone()
        for name, value in trainer.callback_metrics.items()
        if isinstance(value, torch.Tensor) and value.numel() == 1
    }


def restore_callback_metrics(trainer: Any, saved: dict[str, Any]) -> None:
    """Resuming (call in ``on_train_start``): the checkpoint's metrics (:func:`saved_callback_metrics`) back into
    ``trainer.callback_metrics`` where this process has none, and the epoch's ``ReduceLROnPlateau`` step Lightning
    skips on a restart from a checkpoint written at the epoch's end.

    A checkpoint written in ``on_train_epoch_end`` (``ModelCheckpoint``'s default when validation runs at the epoch's
    end) comes before the epoch's plateau step; one written in ``on_validation_end`` (a metric-monitoring
    ``ModelCheckpoint``) before the plateau step of that batch. Lightning 2.6, resuming, skips the first (the
    learning rate then lags a plateau step for the rest of the run) and takes the second without the metric, which
    is in no checkpoint ("ReduceLROnPlateau conditioned on metric ... which is not available" under ``strict``).
    With the saved values both are taken as in the uninterrupted run.
    """
    from lightning.pytorch.trainer import call

    if not saved:
        return
    metrics = trainer._logger_connector._callback_metrics
    for name, value in saved.items():
        metrics.setdefault(name, value)
    fit_loop = trainer.fit_loop
    if not (fit_loop.restarted_on_epoch_end or fit_loop.resumed_on_epoch_end):
        return
    if trainer.lightning_module is None or not trainer.lightning_module.automatic_optimization:
        return
    ended = fit_loop.epoch_progress.current.processed  # the ended epoch's index + 1, as Lightning counts it there
    progress = fit_loop.epoch_loop.scheduler_progress
    for config in trainer.lr_scheduler_configs:
        due = config.reduce_on_plateau and config.interval == "epoch" and ended % config.frequency == 0
        if due and config.monitor in saved:
            progress.increment_ready()
            call._call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, saved[config.monitor])
            progress.increment_completed()


# The reductions `self.log(..., reduce_fx=...)` accepts, by the name a checkpoint records (Lightning compares the
# function objects: a restored entry must hold the very one the module passes).
def _reductions() -> dict[str, Any]:
    import torch

    return {"mean": torch.mean, "sum": torch.sum, "builtins.sum": sum, "max": torch.max, "builtins.max": max,
            "min": torch.min, "builtins.min": min}  # fmt: skip


def epoch_results(trainer: Any) -> tuple[dict[str, dict[str, Any]], list[str]] | None:
    """This rank's epoch aggregates of the training ``self.log(..., on_epoch=True)`` calls so far (Lightning's
    training ``_ResultCollection``), as plain data for a checkpoint, and the names it cannot record (logged with a
    ``sync_dist_group`` or a custom reduction); None outside an epoch's training (before its start hooks ran, or once
    its end began: the next epoch starts afresh there).

    A ``torchmetrics.Metric`` logged as a value is recorded by its attribute name only: its state is the module's.
    """
    fit_loop = trainer.fit_loop
    current = fit_loop.epoch_progress.current
    if not (current.ready == current.started > current.processed == current.completed):
        return None
    names = {id(fn): name for name, fn in _reductions().items()}
    out: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    for key, item in fit_loop.epoch_loop._results.items():
        meta = item.meta
        if item.has_reset or not meta.on_epoch:
            continue
        reduce = names.get(id(meta.reduce_fx))
        if reduce is None or meta.sync.group is not None or (not item.is_tensor and meta.metric_attribute is None):
            skipped.append(meta.name)
            continue
        record: dict[str, Any] = {
            "fx": meta.fx, "name": meta.name, "prog_bar": meta.prog_bar, "logger": meta.logger,
            "on_step": meta.on_step, "on_epoch": meta.on_epoch, "reduce": reduce, "enable_graph": meta.enable_graph,
            "add_dataloader_idx": meta.add_dataloader_idx, "dataloader_idx": meta.dataloader_idx,
            "metric_attribute": meta.metric_attribute, "sync": meta.sync.should,
            "rank_zero_only": meta.sync.rank_zero_only, "tensor": item.is_tensor,
        }  # fmt: skip
        if item.is_tensor:
            record["value"] = item.value.detach().cpu().clone()
            if meta.is_mean_reduction:
                record["count"] = int(item.cumulated_batch_size)
        out[key] = record
    return out, skipped


def metrics_reset_after_this_hook(trainer: Any) -> set[int]:
    """The ids of the ``torchmetrics.Metric`` objects logged as values (``self.log(name, metric)``) that Lightning
    resets once the hook now running returns: those logged in the validation running now (reset after
    ``on_validation_end``), and at a training epoch's end those logged in training (reset after
    ``on_train_epoch_end``). A checkpoint written in such a hook holds them reset, as the run goes on with them."""
    fit_loop = trainer.fit_loop
    current = fit_loop.epoch_progress.current
    collections = []
    if current.processed > current.completed:
        collections.append(fit_loop.epoch_loop._results)
    if trainer.validating or trainer.sanity_checking:
        collections.append(fit_loop.epoch_loop.val_loop._results)
    return {id(item.value) for results in collections for item in results.values() if not item.is_tensor}


def restore_epoch_results(trainer: Any, saved: dict[str, dict[str, Any]]) -> None:
    """Put :func:`epoch_results` back into the training ``_ResultCollection`` of a fit resumed inside the epoch they
    were saved in (call at ``on_train_start``): the epoch's logged aggregates then cover its batches before the
    checkpoint too, as in the uninterrupted run (Lightning 2.6 saves none: after a mid-epoch resume an epoch mean
    covered only the batches after it). The logger connector is put past the epoch's first batch, where Lightning
    would reset the epoch's tensors at the first ``self.log``."""
    import torch
    from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultMetric, _Sync

    if not saved:
        return
    results = trainer.fit_loop.epoch_loop._results
    module = trainer.lightning_module
    device = trainer.strategy.root_device
    reductions = _reductions()
    for key, record in saved.items():
        meta = _Metadata(
            fx=record["fx"], name=record["name"], prog_bar=record["prog_bar"], logger=record["logger"],
            on_step=record["on_step"], on_epoch=record["on_epoch"], reduce_fx=reductions[record["reduce"]],
            enable_graph=record["enable_graph"], add_dataloader_idx=record["add_dataloader_idx"],
            dataloader_idx=record["dataloader_idx"], metric_attribute=record["metric_attribute"],
        )  # fmt: skip
        # As LightningModule.log builds it, so that the module's next call with the same arguments matches.
        meta.sync = _Sync(
            _should=record["sync"], fn=trainer.strategy.reduce, _group=None, rank_zero_only=record["rank_zero_only"]
        )
        if record["tensor"]:
            item = _ResultMetric(meta, True)
            item.value = record["value"].to(device)
            if meta.is_mean_reduction:
                item.cumulated_batch_size = torch.tensor(record["count"], device=device)
        else:
            try:
                value = module.get_submodule(record["metric_attribute"])
            except AttributeError:
                continue
            item = _ResultMetric(meta, False)
            item.value = value
        item._update_count = 1  # updated (in the saved process): computing it at the epoch's end does not warn
        item.has_reset = False
        results[key] = item
    trainer._logger_connector._first_loop_iter = False
    _drop_restored_on_other_arguments(results, set(saved))


def _drop_restored_on_other_arguments(results: Any, keys: set[str]) -> None:
    """Where the resumed module logs a restored key with other arguments than the saved run did (``prog_bar``
    switched on before the relaunch, another reduction), Lightning would refuse the call ("You called `self.log(...)`
    twice ... with different arguments"): the restored aggregate is dropped instead, with a warning, and the call
    goes through. Wraps the collection's ``log`` until each restored key has been logged once."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_bigtrain.warnings import BigtrainWarning, warn_once

    original = results.log

    def log(fx: str, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        key = f"{fx}.{name}"
        if key not in keys:
            return original(fx, name, value, *args, **kwargs)
        keys.discard(key)
        if not keys:
            del results.log  # the collection's own method from here on
        try:
            return original(fx, name, value, *args, **kwargs)
        except MisconfigurationException:  # raised before anything was updated
            results.pop(key, None)
            warn_once(
                f"`self.log({name!r}, ...)` in `{fx}` now has other arguments than in the run that wrote the "
                "checkpoint: its epoch aggregate covers the batches after the resume only.",
                BigtrainWarning,
            )
            return original(fx, name, value, *args, **kwargs)

    results.log = log


def drop_fit_dataloaders(trainer: Any) -> bool:
    """Drop the fit loop's training dataloaders (and their fetcher) when loader states from a checkpoint are
    still waiting to be applied, so that the loop rebuilds them with the states; returns whether it did."""
    fit_loop = trainer.fit_loop
    if not getattr(fit_loop, "_combined_loader_states_to_load", None) or fit_loop._combined_loader is None:
        return False
    if fit_loop._data_fetcher is not None:
        fit_loop._data_fetcher.teardown()
        # The loop makes a new fetcher when it rebuilds the loaders (each epoch's start). A run resumed from its last
        # batch ends without starting an epoch: its teardown would tear this one down again, and fail.
        fit_loop._data_fetcher = None
    fit_loop._combined_loader = None
    return True


def fit_combined_loader(trainer: Any) -> Any:
    """The fit loop's ``CombinedLoader`` of training dataloaders, or None before it is built."""
    return getattr(trainer.fit_loop, "_combined_loader", None)


def combined_mode(combined: Any) -> str:
    """A ``CombinedLoader``'s mode (``"max_size_cycle"``, ``"max_size"``, ``"min_size"``, ``"sequential"``)."""
    return str(getattr(combined, "_mode", "max_size_cycle"))


def rewrap_ddp(strategy: Any) -> None:
    """Wrap the LightningModule in a new ``DistributedDataParallel`` (after its parameters changed shape) and
    register the strategy's communication hooks on it again, as ``DDPStrategy.setup`` does."""
    strategy.model = strategy._setup_model(strategy.lightning_module)
    strategy._register_ddp_hooks()


def forward_redirection(strategy: Any, wrapper: Any, module: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``module.<method>`` through ``wrapper``'s forward (so the wrapper's hooks run around it), as
    Lightning does for DDP/FSDP-wrapped modules. With an FSDP2 root that keeps its parameters gathered after
    forward (``reshard_after_forward=False``), the root stays gathered for backward though the step calls
    ``self(...)`` inside the redirected call (see :func:`_keep_root_gathered`)."""
    return _KeepRootGathered()(wrapper, module, method, *args, **kwargs)


class _KeepRootGathered(_ForwardRedirection):
    @override
    def on_after_inner_forward(self, wrapper_module: Any, original_module: Any) -> None:
        _keep_root_gathered(wrapper_module)


def _keep_root_gathered(root: Any) -> None:
    """A step that calls ``self(...)`` runs the root's forward nested in the redirected call; the inner call's
    post-forward hook leaves the root's parameter group idle, and the outer one then reshards an idle group whatever
    its ``reshard_after_forward``: the root (embeddings, LM head) would be gathered again for backward at ZeRO-1/2.
    Marking the group as still in forward makes the outer hook honour ``reshard_after_forward=False``."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(root, FSDPModule):
        return
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for group in root._get_fsdp_state()._fsdp_param_groups:
        if not group._reshard_after_forward and group._training_state == TrainingState.IDLE:
            group._training_state = TrainingState.FORWARD


def weight_averaging_callbacks(trainer: Any) -> list[Any]:
    """Lightning's ``WeightAveraging`` callbacks (an EMA of the module) that made their average for this fit (its
    private ``_average_model``: an ``AveragedModel`` over a copy of the module)."""
    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # Lightning before 2.6
        return []
    found = [c for c in getattr(trainer, "callbacks", []) if isinstance(c, WeightAveraging)]
    return [c for c in found if getattr(c, "_average_model", None) is not None]


def keep_average_fp32_across_swaps(callback: Any, gather: Any = None) -> None:
    """Lightning's ``WeightAveraging`` swaps its average into the module around each validation by copying values both
    ways (its private ``_swap_models``). Where the module holds 16-bit replicas (``ZeroStrategy`` stages 1-2 in mixed
    precision) the round trip left the fp32 average rounded to 16 bits at every validation: an EMA's increments below
    half a bf16 step of the average were lost. This callback's swap sets the average's fp32 values aside on the way in
    and puts them back on the way out (the module gets its own 16-bit values back exactly); tensors of one dtype are
    swapped as Lightning swaps them. ``gather(pl_module)``, where given, runs before each swap in (see
    :func:`average_fp32_masters`). :func:`restore_average_swap` undoes it."""
    import itertools

    import torch

    held: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def swap(pl_module: Any) -> None:
        average = callback._average_model.module
        if gather is not None and not held:
            gather(pl_module)
        for a, c in zip(itertools.chain(average.parameters(), average.buffers()),
                        itertools.chain(pl_module.parameters(), pl_module.buffers()), strict=False):  # fmt: skip
            if a.dtype == c.dtype:
                kept = a.data.clone()
                a.data.copy_(c.data)
                c.data.copy_(kept)
            elif id(a) in held:  # out: the module's own 16-bit values (``a`` holds them exactly), the fp32 average back
                c.data.copy_(a.data)
                a.data.copy_(held.pop(id(a)))
            else:  # in: the average, rounded, into the module; its fp32 values set aside
                held[id(a)] = a.data.clone()
                a.data.copy_(c.data)
                c.data.copy_(held[id(a)])

    callback._swap_models = swap


class _StandIn:
    """What an averaging callback's update reads as the model: ``parameters()`` (the fp32 masters' values where the
    module holds 16-bit replicas) and ``buffers()``."""

    def __init__(self, params: list[Any], buffers: list[Any] | None = None) -> None:
        self._params, self._buffers = params, buffers or []

    def parameters(self) -> Any:
        return iter(self._params)

    def buffers(self) -> Any:
        return iter(self._buffers)


def average_fp32_masters(callback: Any, engines: Any) -> None:
    """Lightning's ``WeightAveraging`` updates its fp32 average from the module's parameters (``AveragedModel``'s
    ``update_parameters(pl_module)``). Where those are 16-bit replicas (``ZeroStrategy`` stages 1-2 in mixed precision)
    it averaged their bf16 rounding: an update smaller than half a bf16 step of a weight never reached the average,
    which a run under DDP (fp32 parameters, autocast) or stage 3 (fp32 shards) averages. Here each rank updates the
    parts of the average its fp32 master slices cover, from those masters (no communication; the parts it does not
    hold are given the average itself, which an average of equal values leaves as it is), and the parts are
    all-gathered (a collective every rank runs: the hooks below run on every rank) before anything reads the
    average whole: before each swap into the module around validation, before it is copied into the module at the end
    of training, before a checkpoint saves it. ``engines()`` lists the
    :class:`~lightning_bigtrain.engines.flat_shard.FlatShardedOptimizer` s holding the masters. The average pairs
    with the module's parameters by position, as Lightning pairs them. :func:`restore_average_swap` undoes it."""
    import torch

    averaged = callback._average_model

    def paired(pl_module: Any) -> dict[int, torch.Tensor]:
        return {id(p): a for p, a in zip(pl_module.parameters(), averaged.module.parameters(), strict=False)}

    def gather(pl_module: Any) -> None:
        targets = {k: a.data for k, a in paired(pl_module).items()}
        for engine in engines():
            engine.gather_parts_(targets)

    @torch.no_grad()
    def update_parameters(model: Any) -> None:
        pairs = paired(model)
        source: dict[int, torch.Tensor] = {}
        for engine in engines():
            for p, start, stop, master in engine.master_parts():
                average = pairs.get(id(p))
                if average is None:
                    continue
                if start == stop:  # none of it here
                    source[id(p)] = average.detach()
                elif stop - start == p.numel():  # all of it here: the master itself, no copy
                    source[id(p)] = master.view(p.shape)
                else:  # a parameter across two ranks' slices: this rank's part written into a copy of the average
                    source[id(p)] = average.detach().clone()
                    source[id(p)].view(-1)[start:stop].copy_(master)
        params = [source.get(id(p), p) for p in model.parameters()]
        type(averaged).update_parameters(averaged, _StandIn(params, list(model.buffers())))

    def copy_average_to_current(pl_module: Any) -> None:
        gather(pl_module)
        type(callback)._copy_average_to_current(callback, pl_module)

    def on_save_checkpoint(trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        gather(pl_module)
        type(callback).on_save_checkpoint(callback, trainer, pl_module, checkpoint)

    averaged.__dict__["update_parameters"] = update_parameters
    callback._copy_average_to_current = copy_average_to_current
    callback.on_save_checkpoint = on_save_checkpoint
    keep_average_fp32_across_swaps(callback, gather)


def swa_from_fp32_masters(callback: Any, engines: Any) -> None:
    """Lightning's ``StochasticWeightAveraging`` averages the module's parameters once per epoch into an fp32 copy
    (``update_parameters``) and copies the average into the module at its end (``transfer_weights``). Where the module
    holds 16-bit replicas (``ZeroStrategy`` stages 1-2 in mixed precision) it averaged their rounding and its copy
    into them was rounded again: the module ended holding the bf16 rounding of an average of bf16 values (0.99 of its
    values bf16-exact, 3e-3 off the average of the masters on the char-GPT), where DDP's holds the fp32 average of
    fp32 weights. Here the update reads the fp32 masters, gathered whole (a collective; SWA updates at an epoch start,
    on every rank), and the copy into the module writes the fp32 average into the masters too
    (``FlatShardedOptimizer.write_whole_``). ``engines()`` lists the flat optimizers. :func:`restore_average_swap`
    undoes it."""
    import torch

    @torch.no_grad()
    def update_parameters(average_model: Any, model: Any, n_averaged: Any, avg_fn: Any) -> None:
        masters = {id(p): m for engine in engines() for p, m in engine.whole_masters()}
        params = [masters.get(id(p), p) for p in model.parameters()]
        type(callback).update_parameters(average_model, _StandIn(params), n_averaged, avg_fn)

    @torch.no_grad()
    def transfer_weights(source: Any, target: Any) -> None:
        type(callback).transfer_weights(source, target)
        values = {id(t): s for s, t in zip(source.parameters(), target.parameters(), strict=False)}
        for engine in engines():
            engine.write_whole_(values)

    callback.update_parameters = update_parameters
    callback.transfer_weights = transfer_weights


def restore_average_swap(callback: Any) -> None:
    """Lightning's own ``_swap_models`` for ``callback`` again, and its own updates, copy at the end and save (see
    :func:`keep_average_fp32_across_swaps`, :func:`average_fp32_masters`)."""
    for name in ("_swap_models", "_copy_average_to_current", "on_save_checkpoint", "update_parameters",
                 "transfer_weights"):  # fmt: skip
        callback.__dict__.pop(name, None)
    averaged = getattr(callback, "_average_model", None)
    if averaged is not None:
        averaged.__dict__.pop("update_parameters", None)


def logging_step(trainer: Any) -> int:
    """The step Lightning's logger calls carry (``_batches_that_stepped``; at ``on_train_start`` of a resumed fit, the
    checkpoint's, before the restart's own increment)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def logger_version(logger: Any) -> int | str | None:
    """A ``TensorBoardLogger``'s / ``CSVLogger``'s version as given or chosen so far (None: not yet chosen; reading
    ``logger.version`` would choose the next free one)."""
    return logger._version


def set_logger_version(logger: Any, version: int) -> None:
    logger._version = version


def logger_writer_created(logger: Any) -> bool:
    """Whether the logger has created its writer (``logger.experiment``) yet."""
    return logger._experiment is not None


def logger_filesystem(logger: Any) -> Any:
    """A ``CSVLogger``'s fsspec filesystem."""
    return logger._fs


@contextlib.contextmanager
def csv_writer_keeping_files() -> Iterator[None]:
    """While open, a ``CSVLogger`` creating its writer in a folder that holds a ``metrics.csv`` keeps the file
    (Lightning's writer deletes it, with a warning that it will)."""
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter

    original = _ExperimentWriter._check_log_dir_exists
    _ExperimentWriter._check_log_dir_exists = lambda self: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        _ExperimentWriter._check_log_dir_exists = original  # type: ignore[method-assign]
