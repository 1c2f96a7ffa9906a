"""Resuming a checkpoint written in another optimizer-state layout: a plain Lightning file (DDP, CompressedDDPStrategy,
one gathered file), the flat buckets of ZeroStrategy's stages 1-2, or FSDP2's per-parameter shards (stage 3,
offloading), into ``ZeroStrategy`` at any stage and world size.

Every layout converts through one form, the optimizer state *by parameter name* (what
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` returns with ``full_state_dict=True``): ``state``
maps each parameter's name to its whole tensors (``exp_avg`` shaped like the parameter, scalars such as ``step``),
``param_groups`` list the names in each group. A plain optimizer's state is keyed by position in its param groups:
the names come from the optimizer this run built (the same ``configure_optimizers``). A flat checkpoint's buckets are
cut into parameters by the layout saved beside them (:data:`LAYOUT_KEY`).

The whole checkpoint is read into host memory on every rank for the conversion (once, at resume); resuming in the
layout it was written in reads only each rank's shards.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lightning_bigtrain.engines.flat_shard import FlatShardedOptimizer, written_over
from lightning_bigtrain.functional.sharding import local_view

__all__ = [
    "GROUPS_KEY",
    "LAYOUT_KEY",
    "apply_named_state",
    "indexed_optimizer_state",
    "masters_into_state_dict",
    "named_optimizer_state",
    "read_whole",
    "saved_layout_kind",
]

#: Per optimizer: where each parameter lies in each flat bucket, ``[(names, offset, shape), ...]`` per bucket (None
#: for an optimizer that is not flat). Written by ZeroStrategy at stages 1-2.
LAYOUT_KEY = "bigtrain_flat_layout"


#: Per optimizer: its parameters' names per param group, in the order ``configure_optimizers`` gave them (frozen ones
#: included), so that a consolidated file holds optimizer states a plain optimizer loads. Written by ZeroStrategy
#: without tensor or pipeline parallelism.
GROUPS_KEY = "bigtrain_param_groups"


def saved_layout_kind(location: str) -> str:
    """How the checkpoint at ``location`` holds its optimizer states: ``"file"`` (one ``torch.save`` file, Lightning's
    own format), ``"deepspeed"`` (DeepSpeed's folder), ``"flat"`` (ZeroStrategy's stages 1-2: per flat bucket),
    ``"named"`` (per parameter name: FSDP2's), ``"stateless"`` (optimizers saved with their param groups but no
    per-parameter state, as SGD without momentum: any layout loads them) or ``"any"`` (a folder without
    optimizers)."""
    import fsspec

    fs, path = fsspec.url_to_fs(location)
    if not fs.isdir(path):
        return "file"
    if fs.isfile(f"{path.rstrip('/')}/latest"):
        return "deepspeed"
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    reader = FsspecReader(location) if "://" in location else FileSystemReader(location)
    groups = False
    for key in reader.read_metadata().state_dict_metadata:
        parts = key.split(".")
        if len(parts) > 2 and parts[0].startswith("optimizer_") and parts[1] == "state":
            return "flat" if parts[2].isdigit() else "named"
        groups = groups or (len(parts) > 2 and parts[0].startswith("optimizer_") and parts[1] == "param_groups")
    return "stateless" if groups else "any"


def read_whole(location: str, metadata_filename: str) -> dict[str, Any]:
    """The checkpoint at ``location`` (one file, or a torch distributed-checkpoint folder, local or an fsspec URL)
    as whole tensors in host memory, with its optimizer states as the list ``"optimizer_states"``."""
    import fsspec

    fs, path = fsspec.url_to_fs(location)
    if not fs.isdir(path):
        with fsspec.open(location, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=False)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    checkpoint: dict[str, Any] = {}
    reader = FsspecReader(location) if "://" in location else FileSystemReader(location)
    _load_state_dict(checkpoint, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    with fsspec.open(f"{location.rstrip('/')}/{metadata_filename}", "rb") as f:
        checkpoint.update(torch.load(f, map_location="cpu", weights_only=False))
    count = sum(1 for k in checkpoint if k.startswith("optimizer_") and k[len("optimizer_") :].isdigit())
    checkpoint["optimizer_states"] = [checkpoint.pop(f"optimizer_{i}") for i in range(count)]
    return checkpoint


def masters_into_state_dict(checkpoint: dict[str, Any]) -> None:
    """Mixed precision at stages 1-2: replace the 16-bit weights of ``state_dict`` with the fp32 masters kept in the
    flat optimizer states (each bucket's ``"master"``), by the saved layout; where a saved weight is not its master's
    rounding (written after the last step, e.g. a pruning mask applied at the batch's end), the saved one
    (:func:`~lightning_bigtrain.engines.flat_shard.written_over`).

    A ``WeightAveraging`` checkpoint keeps the module's own weights as ``current_model_state`` (``state_dict`` is
    the average, saved in fp32): the masters go there."""
    layouts = checkpoint.get(LAYOUT_KEY) or []
    key = "current_model_state" if isinstance(checkpoint.get("current_model_state"), dict) else "state_dict"
    for states, layout in zip(checkpoint.get("optimizer_states", []), layouts, strict=False):
        if layout is None:
            continue
        for index, bucket in enumerate(layout):
            state = states["state"].get(index, states["state"].get(str(index), {}))
            master = state.get("master")
            if master is None:  # a bucket kept in fp32 (normalization layers): its weights are fp32 already
                continue
            for names, offset, shape in bucket:
                numel = math.prod(shape)
                for name in names:
                    weights = master[offset : offset + numel].reshape(shape)
                    replica = checkpoint[key].get(name)
                    if isinstance(replica, torch.Tensor) and replica.shape == weights.shape:
                        weights = written_over(weights, replica)  # written into the module after the last step
                    checkpoint[key][name] = weights.clone()


def named_optimizer_state(
    saved: dict[str, Any], layout: list[Any] | None, group_names: list[list[str]], where: str
) -> dict[str, Any]:
    """``saved`` (one optimizer's state as written) by parameter name.

    Args:
        saved: ``{"state": ..., "param_groups": ...}`` keyed by name already (FSDP2), by flat bucket (with
            ``layout``), or by position in the param groups (a plain optimizer).
        layout: The flat buckets' layout saved with the checkpoint, for a flat optimizer's state; else None.
        group_names: This run's optimizer: its parameters' names, per param group, in order.
        where: The checkpoint, for error messages.
    """
    state, groups = saved.get("state", {}), saved.get("param_groups", [])
    if all(isinstance(k, str) and not k.isdigit() for k in state) and all(
        all(isinstance(p, str) for p in g["params"]) for g in groups
    ):
        return saved
    if layout is not None:  # flat buckets, in the inner optimizer's order
        named: dict[str, Any] = {}
        bucket_names: list[list[str]] = []
        for index, bucket in enumerate(layout):
            values = state.get(index, state.get(str(index), {}))
            bucket_names.append([names[0] for names, _, _ in bucket])
            total = sum(math.prod(shape) for _, _, shape in bucket)
            for names, offset, shape in bucket:
                numel = math.prod(shape)
                # Every tensor its own copy: a scalar shared between parameters (the bucket's step) would be counted
                # once per parameter by an optimizer that increments its steps in place.
                named[names[0]] = {
                    k: (v[offset : offset + numel].reshape(shape).clone() if v.ndim == 1 and v.numel() == total
                        else v.clone()) if isinstance(v, torch.Tensor) else v
                    for k, v in values.items()
                    if k != "master"
                }  # fmt: skip
        renamed = []
        for group in groups:
            names = [n for b in group["params"] for n in bucket_names[int(b)]]
            renamed.append({**group, "params": names})
        return {"state": named, "param_groups": renamed}
    # A plain optimizer: keyed by position over its param groups.
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(g) for g in group_names]:
        raise ValueError(
            f"Resuming {where}: its optimizer has param groups of {sizes} parameters, this run's "
            f"configure_optimizers {[len(g) for g in group_names]}. Resume with the optimizer it was written with."
        )
    order = [n for g in group_names for n in g]
    position = {p: i for i, p in enumerate(p for g in groups for p in g["params"])}
    named = {order[position[k]]: v for k, v in ((int(k), v) for k, v in state.items())}
    renamed = [{**g, "params": list(names)} for g, names in zip(groups, group_names, strict=True)]
    return {"state": named, "param_groups": renamed}


def indexed_optimizer_state(named: dict[str, Any], group_names: list[list[str]]) -> dict[str, Any]:
    """``named`` (by parameter name) keyed by position over ``group_names``, as a plain optimizer's ``state_dict``
    (what ``torch.optim.Optimizer.load_state_dict`` and plain Lightning resume)."""
    saved_group = {name: g for g in named["param_groups"] for name in g["params"]}
    state, groups, start = {}, [], 0
    for names in group_names:
        hyper: dict[str, Any] = next((saved_group[n] for n in names if n in saved_group), {})
        groups.append(
            {**{k: v for k, v in hyper.items() if k != "params"}, "params": list(range(start, start + len(names)))}
        )
        for offset, name in enumerate(names):
            if name in named["state"]:
                state[start + offset] = named["state"][name]
        start += len(names)
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def apply_named_state(
    optimizer: FlatShardedOptimizer, module: nn.Module, named: dict[str, Any], weights: dict[str, torch.Tensor]
) -> None:
    """Load ``named`` (by parameter name, whole tensors) into a flat optimizer: each bucket's state tensors are the
    parameters' tensors laid end to end, of which this rank keeps its slice; the fp32 masters (mixed precision) are
    the checkpoint's ``weights``."""
    optimizer.init_state()
    target = optimizer.state_dict()
    layout = optimizer.layout(module)
    for index, bucket in enumerate(layout):
        values = target["state"].get(index)
        if not values:
            continue
        names = [names[0] for names, _, _ in bucket]
        for key, value in values.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.ndim == 0:  # a scalar (Adam's step): the same for every parameter the optimizer stepped
                found = next((named["state"][n][key] for n in names if key in named["state"].get(n, {})), None)
                if found is not None:
                    value.copy_(torch.as_tensor(found, dtype=value.dtype))
                continue
            parts = []
            for (_, _, shape), name in zip(bucket, names, strict=True):
                source = weights[name] if key == "master" else named["state"].get(name, {}).get(key)
                parts.append(torch.zeros(math.prod(shape)) if source is None else source.reshape(-1).to(torch.float32))
            whole = torch.cat(parts)
            mine = local_view(value)
            numel = whole.numel()
            chunk = math.ceil(numel / optimizer.world)
            lo = min(optimizer.rank * chunk, numel)
            mine.copy_(whole[lo : lo + mine.numel()].to(mine.dtype))
    # Hyper-parameters (a scheduler's lr, ...) of the saved group holding the same parameters.
    saved_group = {name: g for g in named["param_groups"] for name in g["params"]}
    for group in target["param_groups"]:
        first = next((layout[int(b)][0][0][0] for b in group["params"] if layout[int(b)]), None)
        saved = saved_group.get(first) if first is not None else None
        if saved is not None:
            group.update({k: v for k, v in saved.items() if k != "params"})
    optimizer.load_state_dict(target)
