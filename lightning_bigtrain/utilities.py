"""Reading the training state a Lightning user reads, the same under every strategy.

:func:`grad_norm` is Lightning's ``lightning.pytorch.utilities.grad_norm`` (same keys, same values under DDP) for
gradients a strategy keeps in parts: ``from lightning_bigtrain.utilities import grad_norm`` in place of Lightning's.
Under the sharded strategies ``param.grad`` of the module is not the gradient the optimizer applies (ZeRO-1: the
averaged gradient in this rank's slices, zeros in the others; ZeRO-2 and DeepSpeed: None; ZeRO-3: a DTensor shard,
on which Lightning's function fails), so Lightning's ``grad_norm`` returns other numbers, nothing, or an error there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_bigtrain.engines.flat_shard import flat_grad_part
from lightning_bigtrain.functional.sharding import divided_over, local_view, part_norms

__all__ = ["grad_norm"]

_Part = tuple[torch.Tensor | None, tuple[Any, ...]]


def grad_norm(module: nn.Module, norm_type: float | int | str, group_separator: str = "/") -> dict[str, torch.Tensor]:
    """Each parameter's gradient norm and their overall norm, as Lightning's ``grad_norm`` computes them, from the
    averaged gradients the optimizer is about to apply, under any strategy.

    Call it where Lightning's is called, in ``on_before_optimizer_step`` (after backward, before the step; gradients
    unscaled there): ``self.log_dict(grad_norm(self, norm_type=2))``. Under Lightning's DDP, ``CompressedDDPStrategy``
    and one device it returns what Lightning's returns. Under ``ZeroStrategy`` (stages 1-3, tensor and pipeline
    parallel) and ``DeepSpeedZeroStrategy`` (stages 1-3) it combines each rank's part of every gradient (a flat
    partition, a DTensor shard, a DeepSpeed fragment) with one all-reduce per process group, so there it is a
    collective: call it on every rank (Lightning's hooks run on every rank), never under ``if self.global_rank == 0``.
    Every rank gets every key; under pipeline parallelism also the other stages' parameters (pass the
    ``LightningModule``, whose trainer names the pipeline group). Under DeepSpeed with ``accumulate_grad_batches``
    Lightning calls ``on_before_optimizer_step`` on every micro-batch, and only the last has averaged gradients: the
    others get an empty dict (DDP calls the hook on the last only).

    Args:
        module: The ``LightningModule`` (or a submodule of it) whose parameters' gradients to measure.
        norm_type: The p of the p-norm (``2``, ``1``, ``"inf"``, ...).
        group_separator: Between ``grad_{p}_norm`` and the parameter's name in each key (a logger's folder).

    Returns:
        ``{"grad_{p}_norm{sep}{name}": norm}`` for every parameter with a gradient, and ``"grad_{p}_norm_total"``: the
        norm of all of them as one vector. Values are float32 scalar tensors; empty where no parameter has a gradient.

    Raises:
        ValueError: ``norm_type`` is not positive.
    """
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(
            f"`grad_norm(norm_type={norm_type})`: the norm type must be a positive number or 'inf' (the largest entry)."
        )
    engine = getattr(_strategy(module), "deepspeed_engine", None)
    if engine is not None and not engine.is_gradient_accumulation_boundary():
        return {}  # Lightning calls the hook on every micro-batch under DeepSpeed: nothing is averaged before the last
    names: list[str] = []
    parts: list[_Part] = []
    for name, p in module.named_parameters():
        part = _grad_part(p)
        if part is not None:
            names.append(name)
            parts.append(part)
    values = part_norms(parts, norm_type)
    norms = dict(zip(names, values.unbind(0), strict=True)) if names else {}
    group = _pipeline_group(module)
    if group is not None:
        norms = _across_stages(norms, group)
    if not norms:
        return {}
    result = {f"grad_{norm_type}_norm{group_separator}{name}": value for name, value in norms.items()}
    stacked = torch.stack(list(norms.values()))
    result[f"grad_{norm_type}_norm_total"] = stacked.norm(norm_type)
    return result


def _grad_part(p: Any) -> _Part | None:
    """This rank's part of ``p``'s averaged gradient and the groups its parts are divided over; None: no gradient."""
    flat = flat_grad_part(p)
    if flat is not None:  # ZeroStrategy stages 1-2
        return flat[0], (flat[1],)
    if hasattr(p, "ds_id"):  # DeepSpeed stage 3: this rank's partition
        if not p.requires_grad:
            return None
        from deepspeed.utils import safe_get_local_grad

        local = safe_get_local_grad(p)
        return None if local is None else (_unscaled(local, getattr(p, "_z3_optimizer", None)), (p.ds_process_group,))
    if hasattr(p, "_hp_mapping"):  # DeepSpeed stages 1-2: the fragment of the flat partition this rank owns
        if not p.requires_grad:
            return None
        mapping = p._hp_mapping
        if mapping is None:  # none of it on this rank: it still takes part in the all-reduce
            return None, (p._dp_group,)
        fragment = mapping.get_lp_grad_fragment(p._index_in_param_group).reshape(-1)
        address = mapping.lp_fragment_address
        if fragment.numel() == p.numel():  # an engine that keeps a whole accumulation buffer: only the owned part
            fragment = fragment.narrow(0, address.start, address.numel)
        return _unscaled(fragment, getattr(p, "_zero_optimizer", None)), (p._dp_group,)
    if p.grad is None:
        return None
    return local_view(p.grad), divided_over(p.grad)


def _unscaled(grad: torch.Tensor, optimizer: Any) -> torch.Tensor:
    """DeepSpeed's partitions before its step still carry fp16's loss scale (1 in fp32 and bf16)."""
    scale = float(getattr(optimizer, "loss_scale", 1.0) or 1.0)
    return grad if scale == 1.0 else grad.float() / scale


def _strategy(module: nn.Module) -> Any:
    """The strategy of the Trainer ``module`` (a LightningModule) is attached to, else None."""
    return getattr(getattr(module, "_trainer", None), "strategy", None)


def _pipeline_group(module: nn.Module) -> Any:
    return getattr(_strategy(module), "pipeline_group", None)


def _across_stages(norms: dict[str, torch.Tensor], group: Any) -> dict[str, torch.Tensor]:
    """Every pipeline stage's norms on every rank of the pipeline group, in the module's order (stage by stage); a
    parameter every stage holds (its gradient summed over them) once."""
    device = next(iter(norms.values())).device if norms else torch.device("cpu")
    gathered: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(gathered, [(k, float(v)) for k, v in norms.items()], group=group)
    merged: dict[str, torch.Tensor] = {}
    for stage in gathered:
        for name, value in stage:
            merged.setdefault(name, torch.tensor(value, dtype=torch.float32, device=device))
    return merged
