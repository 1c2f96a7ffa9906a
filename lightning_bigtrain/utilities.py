"""Reading the training state a Lightning user reads, the same under every strategy.

:func:`grad_norm` is Lightning's ``lightning.pytorch.utilities.grad_norm`` (same keys, same values under DDP) for
gradients a strategy keeps in parts: ``from lightning_bigtrain.utilities import grad_norm`` in place of Lightning's.
Under the sharded strategies ``param.grad`` of the module is not the gradient the optimizer applies (ZeRO-1: the
averaged gradient in this rank's slices, zeros in the others; ZeRO-2 and DeepSpeed: None; ZeRO-3: a DTensor shard,
on which Lightning's function fails), so Lightning's ``grad_norm`` returns other numbers, nothing, or an error there.

:func:`full_state_dict` is the module's weights whole, as the model is written, under any strategy: what a user would
``torch.save`` or push to a model hub after ``fit``, where the module itself stays sharded, split or 16-bit.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_bigtrain.engines.flat_shard import flat_grad_part
from lightning_bigtrain.functional.sharding import divided_over, local_view, part_norms

__all__ = ["full_state_dict", "grad_norm"]

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
    others get an empty dict (DDP calls the hook on the last only). After 1-bit Adam's warm-up
    (``CompressedDDPStrategy(OneBitAdam())``) no gradient is averaged: the norms are this rank's local ones (said
    once in a warning).

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
    _warn_if_local_gradients(module)
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


def _warn_if_local_gradients(module: nn.Module) -> None:
    """After 1-bit Adam's warm-up (``CompressedDDPStrategy(OneBitAdam())``) no gradient is averaged: each rank's
    optimizer steps on its own gradient and exchanges compressed momentum. The norms are then this rank's, not of
    the averaged gradient DDP would hold (that exists nowhere), and ranks log different numbers: said once."""
    from lightning_bigtrain.engines.onebit_adam import CompressedMomentumAdam
    from lightning_bigtrain.warnings import warn_once

    for optimizer in getattr(_strategy(module), "optimizers", None) or []:
        inner = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(inner, CompressedMomentumAdam) and inner.compressing:
            warn_once(
                "`grad_norm` after 1-bit Adam's warm-up (`CompressedDDPStrategy(OneBitAdam())`): no gradient is "
                "averaged in this phase (each rank steps on its own gradient and exchanges compressed momentum), so "
                "these are this rank's local gradient norms, not those of an averaged gradient; each rank's differ. "
                "Log them with `sync_dist=True` for their mean over the ranks."
            )
            return


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


def full_state_dict(trainer: Any) -> dict[str, torch.Tensor]:
    """The fitted module's weights whole, on the CPU, in the layout of the model as written: what
    ``YourModule(...).load_state_dict`` takes, under any strategy.

    After ``fit`` the module holds what its strategy made of it: ZeRO-3 and DeepSpeed's stage 3 keep each parameter
    sharded over the ranks, tensor parallelism holds the split blocks (packed q/k/v reordered by rank:
    ``full_tensor()`` of each entry, or torch's ``get_model_state_dict(full_state_dict=True)``, gives those rows in
    another order, a model that loads and is wrong), pipeline parallelism holds one stage's blocks per rank, and
    DeepSpeed's engine in ``"bf16-mixed"`` holds 16-bit copies of its fp32 masters. This gathers them: the masters
    where the optimizer keeps some, packed projections in their own order, every stage's blocks. Under Lightning's
    own strategies (DDP, a single device) and ``CompressedDDPStrategy`` it is rank 0's ``state_dict()``; under
    Lightning's ``ModelParallelStrategy`` (DTensor parameters: FSDP2, its tensor parallelism) torch's full state dict.
    Lightning's ``FSDPStrategy`` (FSDP1 units) is refused: save a checkpoint with ``state_dict_type="full"`` there.

    A collective: call it on every rank (after ``trainer.fit``, in a script every rank runs; or in a hook every rank
    runs). Rank 0 gets the weights, the other ranks ``{}``::

        trainer.fit(model, datamodule=data)
        weights = full_state_dict(trainer)
        if trainer.is_global_zero:
            torch.save(weights, "model.pt")

    As with ``state_dict()``, an entry the module holds whole on the CPU may be that parameter itself (its values
    change as training goes on); called inside ``fit`` to keep a snapshot, clone the entries.

    Args:
        trainer: The Trainer that ran ``fit`` (or ``validate`` / ``test``) with the module.

    Raises:
        ValueError: The trainer has no module attached, or its module holds FSDP1 units (Lightning's
            ``FSDPStrategy``).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    module = getattr(trainer, "lightning_module", None)
    if module is None:
        raise ValueError(
            "`full_state_dict(trainer)`: the trainer has no LightningModule; call it after `trainer.fit(model, ...)` "
            "(or validate / test) with the Trainer that ran it."
        )
    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise ValueError(
            "`full_state_dict(trainer)`: the module holds FSDP1 units (Lightning's `FSDPStrategy`), whose whole state "
            "dict is FSDP1's own collective. Write it with `FSDPStrategy(state_dict_type='full')` and "
            "`trainer.save_checkpoint(path)` (one file, rank 0), or train with `ZeroStrategy(stage=3)` (FSDP2)."
        )
    strategy = trainer.strategy
    own = getattr(strategy, "full_state_dict", None)
    if callable(own):  # ZeroStrategy, DeepSpeedZeroStrategy
        return dict(own())
    if any(hasattr(p, "ds_id") or hasattr(p, "_hp_mapping") for p in module.parameters()):  # Lightning's DeepSpeed
        from lightning_bigtrain.strategies.deepspeed_zero import deepspeed_full_state_dict

        return deepspeed_full_state_dict(module, trainer.global_rank)
    if any(hasattr(p, "placements") for p in module.parameters()):  # DTensor parameters (FSDP2, tensor parallel)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(module, options=options)  # a collective
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)} if trainer.global_rank == 0 else {}
    if trainer.global_rank != 0:
        return {}
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
