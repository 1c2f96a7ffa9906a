"""What a checkpoint must hold for the resumed run to go on as the uninterrupted one: the states of the module's
``torchmetrics`` metrics (not in its ``state_dict``: torchmetrics registers them non-persistent), at every checkpoint
of a fit, and inside an epoch every rank's epoch aggregates of ``self.log(..., on_epoch=True)`` (Lightning saves
none). Without them an epoch metric after a mid-epoch resume covers only the batches after it, a metric counting the
whole run starts again from zero, and what reads them (a ``ReduceLROnPlateau`` on ``train_loss``, ``EarlyStopping``,
a metric-monitoring ``ModelCheckpoint``, the logger) goes another way. A metric Lightning resets right after the
hook that writes the checkpoint (one logged in the validation running, or in training at the epoch's end) is saved
reset, as the run goes on with it.

At the world size of the save each rank takes its own. At another world size (the issue's rule: redistributed by a
documented rule, or reset with a warning naming it):

* a value logged with ``sync_dist=True`` and a metric whose states all reduce by sum, concatenation, max or min (and
  that syncs over all ranks at compute, torchmetrics' default; not under tensor parallelism, where each metric syncs
  over the ranks of its tensor-parallel coordinate) are **merged onto rank 0**, the other ranks starting from the empty
  state: the synced epoch value is the one every saved rank would have given together;
* anything else is rank-local: rank ``r`` takes saved rank ``r``'s where there is one, ranks beyond the saved ones
  start empty, and a warning names what was dropped or started empty.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_bigtrain._compat import epoch_results, metrics_reset_after_this_hook, restore_epoch_results
from lightning_bigtrain.warnings import BigtrainWarning, warn_once

__all__ = ["EPOCH_STATE_KEY", "epoch_state_for_checkpoint", "restore_epoch_state"]

EPOCH_STATE_KEY = "bigtrain_epoch_state"


def epoch_state_for_checkpoint(trainer: L.Trainer) -> dict[str, Any] | None:
    """Every rank's metric states, and inside an epoch's training its logged aggregates; None outside a fit (a
    collective where there are several ranks: call it on every rank, as Lightning calls ``on_save_checkpoint``; what
    is gathered is decided from the trainer's state and loop counters, the same on every rank)."""
    module = trainer.lightning_module
    if module is None or trainer.state.fn != "fit":
        return None
    found = epoch_results(trainer)
    results = None
    if found is not None:
        results, skipped = found
        if skipped:
            warn_once(
                f"Logged values {sorted(set(skipped))} use a `sync_dist_group` or a custom reduction: their epoch "
                "aggregate is not checkpointed, and after a mid-epoch resume it covers the batches after the resume "
                "only.",
                BigtrainWarning,
            )
    local = {"results": results, "metrics": _metric_states(module, metrics_reset_after_this_hook(trainer))}
    world = trainer.world_size
    ranks: list[Any] = [local]
    if world > 1 and dist.is_available() and dist.is_initialized():
        ranks = [None] * world
        dist.all_gather_object(ranks, local)
    return {"epoch": trainer.current_epoch, "world_size": world, "ranks": ranks}


def restore_epoch_state(trainer: L.Trainer, saved: dict[str, Any] | None) -> None:
    """Put :func:`epoch_state_for_checkpoint`'s state back in a resumed fit (call at ``on_train_start``, after the
    loop's pending work is set up): the metric states always, the logged aggregates where the fit continues the epoch
    they were saved in."""
    module = trainer.lightning_module
    if not saved or module is None:
        return
    ranks, rank, world = saved["ranks"], trainer.global_rank, trainer.world_size
    parts = [r["results"] for r in ranks]
    same_epoch = trainer.current_epoch == saved["epoch"] and all(part is not None for part in parts)
    if len(ranks) == world:
        results, metrics = ranks[rank]["results"], ranks[rank]["metrics"]
    else:
        results = _repartition_results(parts, rank, world) if same_epoch else None
        metrics = _repartition_metrics(module, [r["metrics"] for r in ranks], rank, world)
    if same_epoch and results is not None:
        restore_epoch_results(trainer, results)
    _load_metric_states(module, metrics)


def _metrics(module: torch.nn.Module) -> dict[str, Any]:
    from torchmetrics import Metric

    return {name: m for name, m in module.named_modules() if isinstance(m, Metric)}


def _metric_states(module: torch.nn.Module, reset: set[int]) -> dict[str, dict[str, Any]]:
    """Each torchmetrics metric's states (tensors, or lists of them) and update count, on the CPU; ``{"reset":
    True}`` for the metrics in ``reset`` (ids: Lightning resets them right after the hook saving the checkpoint)."""
    out: dict[str, dict[str, Any]] = {}
    for name, metric in _metrics(module).items():
        if id(metric) in reset:
            out[name] = {"reset": True}
            continue
        states = {}
        for state in metric._defaults:
            value = getattr(metric, state)
            states[state] = [v.detach().cpu().clone() for v in value] if isinstance(value, list) else (
                value.detach().cpu().clone())  # fmt: skip
        out[name] = {"states": states, "update_count": int(metric._update_count)}
    return out


def _load_metric_states(module: torch.nn.Module, saved: dict[str, dict[str, Any]]) -> None:
    for name, metric in _metrics(module).items():
        record = saved.get(name)
        if record is None:
            continue
        if record.get("reset"):
            metric.reset()
            continue
        if set(record["states"]) != set(metric._defaults):
            warn_once(
                f"The checkpoint's states of metric {name!r} ({sorted(record['states'])}) are not those of this "
                f"run's {type(metric).__name__} ({sorted(metric._defaults)}): it starts empty.",
                BigtrainWarning,
            )
            continue
        device = metric.device
        for state, value in record["states"].items():
            setattr(metric, state, [v.to(device) for v in value] if isinstance(value, list) else value.to(device))
        metric._update_count = record["update_count"]
        metric._computed = None


# How two ranks' parts of a state combine, by reduction: mean values are sums of value x batch size, so they add
# (and their counts add); torchmetrics names its reductions ``dim_zero_<kind>``.
_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add,
    "max": torch.maximum,
    "min": torch.minimum,
}
_START = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}  # Lightning's initial value per reduction


def _kind(reduce: str) -> str:
    """``"sum"``, ``"max"`` or ``"min"`` for a logged value's reduction name (``"mean"``, ``"builtins.max"``, ...)."""
    name = reduce.rsplit(".", 1)[-1]
    return "sum" if name == "mean" else name


def _repartition_results(saved: list[dict[str, Any]], rank: int, world: int) -> dict[str, Any]:
    """Values synced at the epoch's end merged onto rank 0; the others by rank index (see the module docstring)."""
    out: dict[str, Any] = {}
    local: set[str] = set()
    for index, part in enumerate(saved):
        for key, record in part.items():
            if record["tensor"] and record["sync"] and not record["rank_zero_only"]:
                if key not in out:
                    # Every rank has the entry (its epoch-end sync is a collective); rank 0 holds the merged value.
                    out[key] = copy.deepcopy(record) if rank == 0 else _empty(record)
                    continue
                if rank != 0:
                    continue
                merged = out[key]
                merged["value"] = _COMBINE[_kind(record["reduce"])](merged["value"], record["value"])
                if "count" in record:
                    merged["count"] += record["count"]
            else:
                local.add(record["name"])
                if index == rank:
                    out[key] = record
    if local:
        warn_once(
            f"The checkpoint was written by {len(saved)} ranks, this run has {world}: the epoch aggregates of "
            f"{sorted(local)} are rank-local (not `sync_dist=True`): ranks beyond the saved ones start them empty, "
            "saved ranks beyond this run's are dropped.",
            BigtrainWarning,
        )
    return out


def _empty(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` holding nothing yet (Lightning's initial value for its reduction)."""
    empty = dict(record)
    empty["value"] = torch.full_like(record["value"], _START[_kind(record["reduce"])])
    if "count" in record:
        empty["count"] = 0
    return empty


_MERGEABLE = ("dim_zero_sum", "dim_zero_cat", "dim_zero_max", "dim_zero_min")


def _repartition_metrics(
    module: torch.nn.Module, saved: list[dict[str, Any]], rank: int, world: int
) -> dict[str, dict[str, Any]]:
    """Metrics that sync by sum, concatenation, max or min merged onto rank 0; the others by rank index."""
    out: dict[str, dict[str, Any]] = {}
    local: list[str] = []
    for name, metric in _metrics(module).items():
        parts = [part[name] for part in saved if name in part and not part[name].get("reset")]
        if not any(name in part for part in saved):
            continue
        if not parts:
            out[name] = {"reset": True}
            continue
        kinds = {state: getattr(metric._reductions.get(state), "__name__", None) for state in metric._defaults}
        synced_over_all = metric.sync_on_compute and metric.dist_sync_fn is None and metric.process_group is None
        if synced_over_all and all(k in _MERGEABLE for k in kinds.values()):
            if rank == 0:
                out[name] = _merge_metric(parts, kinds)
            continue
        local.append(name)
        if rank < len(saved) and name in saved[rank]:
            out[name] = saved[rank][name]
    if local:
        warn_once(
            f"The checkpoint was written by {len(saved)} ranks, this run has {world}: the states of metrics "
            f"{local} are rank-local (a reduction other than sum, cat, max or min, or not synced over all ranks): "
            "ranks beyond the saved ones start them empty, saved ranks beyond this run's are dropped.",
            BigtrainWarning,
        )
    return out


def _merge_metric(parts: list[dict[str, Any]], kinds: dict[str, str | None]) -> dict[str, Any]:
    states: dict[str, Any] = {}
    for state, kind in kinds.items():
        values = [part["states"][state] for part in parts]
        if isinstance(values[0], list):
            states[state] = [v for value in values for v in value]
        elif kind == "dim_zero_cat":
            states[state] = torch.cat([v.reshape(1) if v.dim() == 0 else v for v in values])
        else:
            combine = _COMBINE[str(kind).removeprefix("dim_zero_")]
            merged = values[0]
            for value in values[1:]:
                merged = combine(merged, value)
            states[state] = merged
    return {"states": states, "update_count": sum(part["update_count"] for part in parts)}
