"""BF16Precision: pure-bf16 training (parameters, gradients, optimizer states) with compensated updates."""

from __future__ import annotations

from typing import Any, get_args

import torch
from lightning.pytorch.plugins.precision import HalfPrecision
from torch import nn
from typing_extensions import override

from lightning_bigtrain.engines.compensated import CompensatedStep
from lightning_bigtrain.functional.bf16 import Compensation, check_optimizer

__all__ = ["BF16Precision"]


class BF16Precision(HalfPrecision):
    """Train entirely in bf16, with every optimizer step compensated so training tracks fp32.

    Lightning's ``precision="bf16-true"`` loses updates smaller than half a bf16 unit in the last place;
    ``"bf16-mixed"`` keeps fp32 parameters and so saves no model-state memory. This plugin keeps
    parameters, gradients and optimizer states in bf16 (AdamW: 8 bytes per parameter instead of 16) and
    runs each optimizer step in fp32 over a chunk of parameters at a time, writing back with Kahan
    compensation (a bf16 buffer per parameter, 10 bytes per parameter in all) or stochastic rounding
    (see :mod:`lightning_bigtrain.functional.bf16`). Any element-wise torch optimizer from
    ``configure_optimizers`` works unchanged; its states become bf16 and the Kahan buffers live in its
    state, so they are checkpointed, and sharded by ``ZeroStrategy``, with it.

    Use as ``Trainer(plugins=[BF16Precision("kahan")])`` (without a ``precision=`` argument).

    Acts in: ``convert_module`` (model to bf16, dtype checked), ``convert_input`` / ``forward_context``
    (inputs and new tensors in bf16, as ``"bf16-true"``), ``connect`` (after the strategy built the
    optimizers: each optimizer's step replaced by the compensated one; for ZeroStrategy's sharded
    optimizer, the inner optimizer over the shards), ``state_dict`` / ``load_state_dict`` (rounding
    seed and step count, for exact resume).

    Args:
        compensation: ``"kahan"`` (default; 2 extra bytes per parameter), ``"stochastic"`` (unbiased
            stochastic rounding; no extra memory) or ``"none"`` (fp32 step, round to nearest: the
            uncompensated baseline).
        chunk_numel: Most parameter elements stepped together in fp32 (bounds the step's transient memory).
    """

    def __init__(self, compensation: Compensation = "kahan", *, chunk_numel: int = 1 << 22) -> None:
        if compensation not in get_args(Compensation):
            raise ValueError(
                f"`BF16Precision(compensation={compensation!r})` is not supported: choose one of "
                f"{', '.join(map(repr, get_args(Compensation)))}."
            )
        if chunk_numel < 1:
            raise ValueError(f"`BF16Precision(chunk_numel={chunk_numel})`: must be >= 1.")
        super().__init__("bf16-true")
        self.compensation = compensation
        self.chunk_numel = chunk_numel
        self.steppers: list[CompensatedStep] = []
        self._seed: int | None = None
        self._restored: dict[str, Any] | None = None
        self._averaged: list[Any] = []  # Lightning's WeightAveraging callbacks given an fp32-keeping swap

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        dtypes = {str(p.dtype) for p in module.parameters() if p.is_floating_point()}
        others = sorted(dtypes - {"torch.float32", "torch.bfloat16"})
        if others:
            raise ValueError(
                f"`BF16Precision` got a model with {', '.join(others)} parameters ({type(module).__name__}). It "
                "converts fp32 (or bf16) models to bf16; build the model in fp32 (or call `model.float()`)."
            )
        return module.to(dtype=torch.bfloat16)

    @override
    def connect(self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]) -> tuple[Any, ...]:
        from lightning_bigtrain.engines.flat_shard import FlatShardedOptimizer

        for stepper in self.steppers:
            stepper.detach()
        self.steppers = []
        seed = self._shared_seed()
        for optimizer in optimizers:
            inner = optimizer.inner if isinstance(optimizer, FlatShardedOptimizer) else optimizer
            check_optimizer(inner)
            dtypes = {p.dtype for g in inner.param_groups for p in g["params"] if p.requires_grad}
            if dtypes - {torch.bfloat16}:
                raise ValueError(
                    f"`BF16Precision`: {type(inner).__name__} holds {sorted(map(str, dtypes))} parameters; all must "
                    "be bf16. Create the optimizer in `configure_optimizers` (after the plugin converted the model)."
                )
            self.steppers.append(CompensatedStep(inner, self.compensation, seed=seed, chunk_numel=self.chunk_numel))
        if self._restored is not None:
            self.load_state_dict(self._restored)
        self._keep_averages_fp32(model)
        return super().connect(model, optimizers, lr_schedulers)

    def _keep_averages_fp32(self, model: nn.Module) -> None:
        """Lightning's ``WeightAveraging`` keeps an fp32 average of this bf16 module and swaps it into the module
        around each validation by copying both ways: the round trip rounded the whole average to bf16 at every
        validation (all of its values bf16-exact after a few), so the average stopped taking increments below half a
        bf16 step. Its swap sets the fp32 values aside instead (:func:`~lightning_bigtrain._compat.
        keep_average_fp32_across_swaps`); undone at teardown."""
        import lightning as L

        from lightning_bigtrain._compat import keep_average_fp32_across_swaps, weight_averaging_callbacks

        module = next((m for m in model.modules() if isinstance(m, L.LightningModule)), None)
        trainer = getattr(module, "_trainer", None)
        if trainer is None:
            return
        for callback in weight_averaging_callbacks(trainer):
            if callback.__dict__.get("_swap_models") is None:  # (a strategy may have given it its own already)
                keep_average_fp32_across_swaps(callback)
                self._averaged.append(callback)

    @override
    def teardown(self) -> None:
        from lightning_bigtrain._compat import restore_average_swap

        for callback in self._averaged:
            restore_average_swap(callback)
        self._averaged = []
        super().teardown()

    def _shared_seed(self) -> int:
        """Rank 0's seed, so data-parallel replicas round their identical updates identically."""
        if self._seed is None:
            seed = [torch.initial_seed()]
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.broadcast_object_list(seed, src=0)
            self._seed = int(seed[0])
        return self._seed

    @override
    def state_dict(self) -> dict[str, Any]:
        if not self.steppers:
            return {}
        return {"compensation": self.compensation, "seed": self._seed, "steps": [s.steps for s in self.steppers]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if state_dict.get("compensation") != self.compensation:
            raise ValueError(
                f"`BF16Precision(compensation={self.compensation!r})` cannot resume a checkpoint written with "
                f"compensation={state_dict.get('compensation')!r}: the optimizer state differs. Use the same setting."
            )
        self._seed = int(state_dict["seed"])
        if not self.steppers:  # restored before the strategy connected the optimizers
            self._restored = state_dict
            return
        for stepper, steps in zip(self.steppers, state_dict["steps"], strict=False):
            stepper.seed = self._seed
            stepper.steps = int(steps)
        self._restored = None
