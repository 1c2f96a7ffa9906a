"""OperatorFusion: compile applied after the strategy wraps the model, the optimizer on its fused kernel, and a
measured choice that keeps eager when compiling does not pay."""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any, Literal, Protocol, cast, get_args

import lightning as L
import torch
from torch import nn
from typing_extensions import override

from lightning_bigtrain.functional.fusion import fuse_optimizer, repeated_blocks, supports_fused
from lightning_bigtrain.functional.surgery import (
    Swap,
    check_kinds,
    refresh_swaps,
    restore_modules,
    sdpa_fallbacks,
    swap_modules,
)
from lightning_bigtrain.warnings import BigtrainWarning, NoEffectWarning, warn_once

__all__ = ["OperatorFusion"]

CompileMode = Literal["auto", "regional", "full", "off"]
AUTO_LOSS_MIN_VOCAB = 8192


class _DeclaresFusedLoss(Protocol):
    """A module that declares the chunked LM-head loss switch (the char-GPT does)."""

    fused_lm_head_loss: bool


class OperatorFusion(L.Callback):
    """Fuse operators of any LightningModule's training step, chosen by measurement.

    * ``compile``: ``"regional"`` compiles each repeated block (transformer blocks, ResNet blocks; see
      :func:`~lightning_bigtrain.functional.fusion.repeated_blocks`) once and reuses the code for every
      instance, so start-up costs one block's compile; ``"full"`` compiles the module's whole ``forward``;
      ``"off"`` keeps eager; ``"auto"`` runs the first training steps under each candidate (``off``, then
      ``regional`` and ``full``), times ``trial_steps`` steps of each after ``warmup_steps`` (compiling happens
      there), keeps the fastest, logs the choice (``fusion/choice``: 0 off, 1 regional, 2 full) and reports the
      timings. Eager is kept unless a compiled candidate is faster by more than ``min_gain``, so the result
      is never slower than eager beyond the noise of the trial. Those steps are ordinary training steps:
      compiling changes the arithmetic's rounding only.
    * Compile is applied in ``on_train_start``: after the strategy has wrapped the model (DDP,
      CompressedDDPStrategy, ZeroStrategy), which Lightning does not redo when a module was compiled before
      ``fit`` (PL#20242). Callbacks that change the model (pruning) run before: list them first.
    * ``fused_optimizer``: the optimizer from ``configure_optimizers`` is rebuilt with its fused kernel (torch
      uses the for-loop implementation on CPU by default), state, param groups and LR-scheduler links kept.
      Optimizers that a strategy wraps (ZeroStrategy stages 1-2, DeepSpeed) or that hold sharded tensors are
      left as they are, with a warning saying why.
    * ``fused_loss``: modules that declare ``fused_lm_head_loss`` (the char-GPT does) compute their training
      loss with :func:`~lightning_bigtrain.functional.fused_loss.chunked_linear_cross_entropy` when it is set:
      ``True`` sets it, ``"auto"`` sets it from a vocabulary of 8,192 up (below, the logits are small and
      chunking only costs time; the measurements are in the method card, ``docs/fusion.md``), ``False`` leaves
      it. Not with KnowledgeDistillation (it needs the logits). The module's flag is put back at teardown.
    * ``swap_modules``: module surgery (:mod:`lightning_bigtrain.functional.surgery`) before compiling.
      ``True`` swaps attention written by hand (``softmax(q @ k^T) @ v``) for ``scaled_dot_product_attention``
      (a fused kernel that does not keep the score matrix for backward); ``"norm_activation"`` (opt-in: less
      activation memory for some recompute time) runs each norm + activation pair as one recomputed unit; a
      list picks kinds, ``False`` none. Swaps keep parameters and ``state_dict`` keys, follow structural pruning
      (re-traced when a module's structure changes) and are undone at teardown. Conv+BN folding is for
      evaluation: :func:`~lightning_bigtrain.functional.surgery.fold_conv_bn`. On CPU, attention with active
      dropout keeps its written math in training (SDPA has no fused kernel with dropout there): such swaps are
      named in a :class:`~lightning_bigtrain.warnings.NoEffectWarning`, listed in ``fallbacks`` and logged as
      ``fusion/swap_fallbacks``, not in ``fusion/swaps``. Speed and memory: ``docs/fusion.md``.
    * A model the compiler cannot handle (the backend fails: no working C++ compiler, an Inductor error) falls
      back to eager for the rest of the run with a warning; errors from the model's own code propagate.
    * Graph breaks (with TorchDynamo's reasons) and the number of graphs compiled during the run are reported
      at the end and logged (``fusion/graph_breaks``, ``fusion/graphs``); a recompilation storm (more than 8
      graphs per compiled module) is warned about.

    Args:
        compile: ``"auto"``, ``"regional"``, ``"full"`` or ``"off"``.
        fused_optimizer: Rebuild the optimizer on its fused kernel.
        fused_loss: Switch on a declared chunked LM-head loss (``True``, ``False`` or ``"auto"``).
        swap_modules: ``True`` (attention), ``False``, or the swap kinds to apply (``"attention"``,
            ``"norm_activation"``).
        warmup_steps: Steps per ``auto`` candidate before timing (its compile happens here).
        trial_steps: Timed steps per ``auto`` candidate.
        min_gain: A compiled candidate must be this much faster than eager (relative) to be kept.
    """

    def __init__(
        self,
        compile: CompileMode = "auto",
        *,
        fused_optimizer: bool = True,
        fused_loss: bool | Literal["auto"] = "auto",
        swap_modules: bool | Sequence[str] = True,
        warmup_steps: int = 2,
        trial_steps: int = 5,
        min_gain: float = 0.03,
    ) -> None:
        if compile not in get_args(CompileMode):
            raise ValueError(
                f"`OperatorFusion(compile={compile!r})`: choose one of {', '.join(get_args(CompileMode))}."
            )
        if warmup_steps < 1 or trial_steps < 1:
            raise ValueError(
                f"`OperatorFusion(warmup_steps={warmup_steps}, trial_steps={trial_steps})`: both must be >= 1 "
                "(the first compiled step compiles; timing it would measure the compiler)."
            )
        if fused_loss not in (True, False, "auto"):
            raise ValueError(f"`OperatorFusion(fused_loss={fused_loss!r})`: pass True, False or 'auto'.")
        if not 0 <= min_gain < 1:
            raise ValueError(f"`OperatorFusion(min_gain={min_gain})`: must be in [0, 1).")
        if swap_modules is True:
            self.swap_kinds: tuple[str, ...] = ("attention",)
        elif swap_modules is False:
            self.swap_kinds = ()
        else:
            self.swap_kinds = check_kinds(
                swap_modules, f"`OperatorFusion(swap_modules={swap_modules!r})` (or True/False)"
            )
        self._swaps_named = swap_modules is not True
        self.swaps: list[Swap] = []
        self.fallbacks: list[Swap] = []
        self.compile = compile
        self.fused_optimizer = fused_optimizer
        self.fused_loss = fused_loss
        self.fused_loss_active = False
        self.warmup_steps = warmup_steps
        self.trial_steps = trial_steps
        self.min_gain = min_gain
        self.choice: str | None = None
        self.timings: dict[str, float] = {}
        self._trials: list[str] = []
        self._step_times: list[float] = []
        self._t0: float | None = None
        self._compiled: list[nn.Module] = []
        self._counters_at_start: dict[str, Any] = {}
        self._modules_compiled = 0

    # ------------------------------------------------------------------------------------------------ set-up
    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._switch_loss(trainer, pl_module)
        self._swap(trainer, pl_module)
        if self.fused_optimizer:
            self._fuse_optimizers(trainer)
        self._counters_at_start = _dynamo_counts()
        if self.compile == "auto":
            self._trials = ["off", "regional", "full"]
            if not repeated_blocks(pl_module):
                self._trials.remove("regional")
            self._apply(pl_module, self._trials[0])
        else:
            self.choice = self.compile
            self._apply(pl_module, self.compile)

    def _swap(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.swap_kinds:
            return
        self.swaps = swap_modules(pl_module, self.swap_kinds)
        for kind in self.swap_kinds:
            if self._swaps_named and not any(s.kind == kind for s in self.swaps):
                warn_once(
                    f"OperatorFusion(swap_modules=[{kind!r}]) has no effect: no module of {type(pl_module).__name__} "
                    f"matches the {kind!r} pattern (see lightning_bigtrain.functional.surgery).",
                    NoEffectWarning,
                )
        # On CPU, attention with active dropout keeps its written math in training (SDPA has no fused kernel with
        # dropout there): said and logged as such, not counted as a swap.
        self.fallbacks = sdpa_fallbacks(pl_module, self.swaps)
        if self.fallbacks:
            paths = ", ".join(s.path or type(pl_module).__name__ for s in self.fallbacks[:4])
            warn_once(
                f"OperatorFusion(swap_modules=...): {len(self.fallbacks)} attention swap(s) ({paths}"
                f"{' ...' if len(self.fallbacks) > 4 else ''}) keep the written math in training: on CPU, "
                "scaled_dot_product_attention has no fused kernel with dropout, so they run SDPA in evaluation "
                "only. Train on a GPU, or set the attention dropout to 0, for the fused kernel.",
                NoEffectWarning,
            )
        if self.swaps:
            kinds = sorted({s.kind for s in self.swaps})
            note = f"; {len(self.fallbacks)} keep the written math in training (CPU, dropout)" if self.fallbacks else ""
            rank_zero_print(trainer, f"OperatorFusion swapped {len(self.swaps)} pattern(s) ({', '.join(kinds)}) in "
                                     f"{len({s.path for s in self.swaps})} module(s){note}.")  # fmt: skip
        for logger in trainer.loggers:
            logger.log_metrics({"fusion/swaps": len(self.swaps) - len(self.fallbacks),
                                "fusion/swap_fallbacks": len(self.fallbacks)}, step=trainer.global_step)  # fmt: skip

    def _switch_loss(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Turn on a declared chunked LM-head loss: ``fused_loss=True``, or ``"auto"`` from a vocabulary of
        ``AUTO_LOSS_MIN_VOCAB`` classes up (below it the logits are small and chunking only costs time)."""
        if self.fused_loss is False:
            return
        declared = hasattr(pl_module, "fused_lm_head_loss")
        if not declared:
            if self.fused_loss is True:
                warn_once(
                    f"OperatorFusion(fused_loss=True) has no effect: {type(pl_module).__name__} does not declare "
                    "`fused_lm_head_loss` (set it and compute the loss with "
                    "lightning_bigtrain.functional.fused_loss.chunked_linear_cross_entropy when it is True).",
                    NoEffectWarning,
                )
            return
        head = getattr(pl_module, "lm_head", None)
        vocab = getattr(head, "out_features", 0)
        if self.fused_loss == "auto" and vocab < AUTO_LOSS_MIN_VOCAB:
            return
        from lightning_bigtrain.callbacks.distillation import KnowledgeDistillation

        # `Trainer.callbacks` is set at init but not declared on the class.
        if any(isinstance(c, KnowledgeDistillation) for c in getattr(trainer, "callbacks", ())):
            warn_once(
                "OperatorFusion: the chunked LM-head loss stays off with KnowledgeDistillation, which needs the "
                "student's logits.",
                NoEffectWarning,
            )
            return
        cast(_DeclaresFusedLoss, pl_module).fused_lm_head_loss = True
        self.fused_loss_active = True

    def _fuse_optimizers(self, trainer: L.Trainer) -> None:
        fused = []
        for optimizer in trainer.optimizers:
            reason = supports_fused(optimizer)
            if reason is not None:
                name = type(optimizer).__qualname__
                warn_once(f"OperatorFusion(fused_optimizer=True) left {name} as it is: {reason}.", NoEffectWarning)
                fused.append(optimizer)
                continue
            new = fuse_optimizer(optimizer)
            for config in trainer.lr_scheduler_configs:
                if getattr(config.scheduler, "optimizer", None) is optimizer:
                    config.scheduler.optimizer = new
            fused.append(new)
        trainer.strategy.optimizers = fused

    def _apply(self, pl_module: L.LightningModule, mode: str) -> None:
        """Switch the module to ``mode`` (undoing what an earlier trial compiled)."""
        for m in self._compiled:
            m._compiled_call_impl = None  # nn.Module.compile's handle: None restores the eager forward
            vars(m).pop("forward", None)  # (a sharded unit's compiled forward: the class's again)
        self._compiled = []
        if mode == "regional":
            self._compiled = repeated_blocks(pl_module)
            if not self._compiled:
                warn_once(
                    f"OperatorFusion(compile='regional'): {type(pl_module).__name__} has no repeated blocks; "
                    "compiling the whole forward instead.",
                    NoEffectWarning,
                )
                self._compiled = [pl_module]
        elif mode == "full":
            self._compiled = [pl_module]
        from torch.distributed.fsdp import FSDPModule

        for m in self._compiled:
            if isinstance(m, FSDPModule):
                # A sharded unit (ZeRO-3): its gather/reshard hooks run in `_call_impl` and are excluded from
                # compilation, a graph break that left the whole block eager (nn.TransformerEncoderLayer): compile
                # its forward only, the hooks around it stay eager.
                m.forward = _FallbackToEager(m, torch.compile(m.forward), forward=True)
            else:
                m._compiled_call_impl = _FallbackToEager(m, torch.compile(m._call_impl))
        self._modules_compiled += len(self._compiled)

    # ----------------------------------------------------------------------------------------- auto trials
    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.swaps and self._compiled:  # compiled code skips the structure check in the swapped forward
            self.swaps = refresh_swaps(pl_module)
        if self._trials:
            self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._trials or self._t0 is None:
            return
        self._step_times.append(time.perf_counter() - self._t0)
        if len(self._step_times) < self.warmup_steps + self.trial_steps:
            return
        timed = sorted(self._step_times[self.warmup_steps :])
        self.timings[self._trials[0]] = timed[len(timed) // 2]  # median
        self._step_times = []
        self._trials.pop(0)
        if self._trials:
            self._apply(pl_module, self._trials[0])
            return
        eager = self.timings["off"]
        best = min(self.timings, key=self.timings.__getitem__)
        self.choice = best if self.timings[best] < eager * (1 - self.min_gain) else "off"
        self._apply(pl_module, self.choice)
        summary = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.timings.items())
        rank_zero_print(trainer, f"OperatorFusion(compile='auto') chose {self.choice!r} (median step: {summary}).")
        for logger in trainer.loggers:
            logger.log_metrics({"fusion/choice": ["off", "regional", "full"].index(self.choice),
                                **{f"fusion/step_ms_{k}": v * 1e3 for k, v in self.timings.items()}},
                               step=trainer.global_step)  # fmt: skip

    # ---------------------------------------------------------------------------------------------- report
    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        counts = _dynamo_counts()
        breaks = counts["graph_breaks"] - self._counters_at_start.get("graph_breaks", 0)
        graphs = counts["graphs"] - self._counters_at_start.get("graphs", 0)
        for logger in trainer.loggers:
            logger.log_metrics({"fusion/graph_breaks": breaks, "fusion/graphs": graphs}, step=trainer.global_step)
        if breaks:
            new = [r for r in counts["reasons"] if r not in self._counters_at_start.get("reasons", [])]
            warnings.warn(
                f"OperatorFusion: TorchDynamo broke the compiled graph {breaks} time(s) in this run"
                f"{' (' + '; '.join(new[:3]) + ')' if new else ''}: the code between breaks runs eagerly. "
                "Run with TORCH_LOGS=graph_breaks for where; compile='off' avoids it.",
                BigtrainWarning,
                stacklevel=2,
            )
        # Each compiled module needs a forward and a backward graph, a few more for the last, smaller batch or
        # a train/eval switch; many more means shapes or guards keep changing (a recompilation storm).
        if graphs > 8 * max(1, self._modules_compiled):
            warnings.warn(
                f"OperatorFusion: {graphs} graphs were compiled for {self._modules_compiled} compiled module(s): "
                "changing batch shapes or Python values recompile the model. Pad batches to fixed shapes "
                "(or drop_last=True), or use compile='off'.",
                BigtrainWarning,
                stacklevel=2,
            )

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.fused_loss_active:
            cast(_DeclaresFusedLoss, pl_module).fused_lm_head_loss = False
            self.fused_loss_active = False
        if self._trials:  # stopped during the auto trials: leave the module eager
            self._apply(pl_module, "off")
        self._trials = []
        if self.swaps:
            restore_modules(pl_module)
            self.swaps = []
        self.fallbacks = []


class _FallbackToEager:
    """A module's compiled call that, when the compiler itself fails (no working C++ compiler, a backend error),
    switches the module back to eager for the rest of the run with a warning instead of ending the fit.
    Errors raised by the model's own code propagate unchanged."""

    def __init__(self, module: nn.Module, compiled: Any, forward: bool = False) -> None:
        self.module = module
        self.compiled = compiled
        self.forward = forward  # compiled: the module's forward (else its whole call)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.exc import TorchDynamoException

        try:
            return self.compiled(*args, **kwargs)
        except TorchDynamoException as error:
            self.module._compiled_call_impl = None
            vars(self.module).pop("forward", None)
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            warn_once(
                f"OperatorFusion: compiling {type(self.module).__name__} failed ({type(error).__name__}: {reason}); "
                "it runs eagerly for the rest of the run. Fix the compiler set-up or pass compile='off'.",
                BigtrainWarning,
            )
            return self.module.forward(*args, **kwargs) if self.forward else self.module._call_impl(*args, **kwargs)


def _dynamo_counts() -> dict[str, Any]:
    """TorchDynamo's process-wide counters: graph breaks (with their reasons) and graphs compiled."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return {"graph_breaks": 0, "graphs": 0, "reasons": []}
    reasons = [*counters["graph_break"], *counters["unimplemented"]]
    return {
        "graph_breaks": int(sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())),
        "graphs": int(counters["stats"].get("unique_graphs", 0)),
        "reasons": [str(r).splitlines()[0] for r in reasons],
    }


def rank_zero_print(trainer: L.Trainer, message: str) -> None:
    if trainer.is_global_zero:
        print(message, flush=True)
