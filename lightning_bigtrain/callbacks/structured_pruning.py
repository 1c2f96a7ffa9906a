"""StructuredPruning: remove whole channels, neurons, filters and attention heads during training, and
load_pruned for the checkpoints it writes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import lightning as L
import torch
from torch import nn
from typing_extensions import override

from lightning_bigtrain._compat import rewrap_ddp
from lightning_bigtrain.callbacks._pruning_schedule import PruningSchedule
from lightning_bigtrain.functional.pruning import cubic_sparsity
from lightning_bigtrain.warnings import BigtrainWarning, NoEffectWarning, warn_once

__all__ = ["StructuredPruning", "load_pruned"]

Importance = Literal["l2", "taylor"]
_STRUCTURE_KEY = "bigtrain_structured_pruning"
_ATTENTION_KEY = "bigtrain_headed_attention"


def _swap_as_saved(module: nn.Module, checkpoint: dict[str, Any]) -> None:
    """Rebuild the attention swap a checkpoint was written with (its weights are named q_proj/k_proj/v_proj)."""
    names = checkpoint.get(_ATTENTION_KEY)
    if names:
        from lightning_bigtrain.functional.attention import swap_multihead_attention_

        swap_multihead_attention_(module, names)


def _averages_weights(callback: object) -> bool:
    """Lightning's weight-averaging callbacks (``WeightAveraging`` / ``EMAWeightAveraging``, SWA)."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    try:
        from lightning.pytorch.callbacks import WeightAveraging
    except ImportError:  # Lightning before 2.6
        return isinstance(callback, StochasticWeightAveraging)
    return isinstance(callback, (StochasticWeightAveraging, WeightAveraging))


class StructuredPruning(L.Callback):
    """Remove whole channels, neurons and filters during training, so the model really gets smaller and faster.

    The model is traced once (``torch.fx``, on the input of its first training batch) into channel groups
    (:mod:`lightning_bigtrain.functional.structured`): producers, consumers, BatchNorms and residual partners that
    must lose the same channels. At each event of ``schedule`` every prunable group is cut to
    ``1 - amount_t`` of its original channels (``amount_t`` on Zhu & Gupta's cubic ramp), keeping the most
    important ones. Layers are resized in place: parameters keep their identity, the optimizer's state (momentum,
    Adam moments) is sliced with them, and DDP is re-wrapped over the new shapes. Channels the tracer cannot
    follow (reshapes that mix channels, LayerNorm-coupled widths, the model's output) are kept, and listed once in
    a warning. Attention modules that declare their heads (``n_head`` and ``head_slots()``) lose whole heads.
    Latency, size and accuracy of pruned models: the method card, ``docs/pruning.md``.

    Hooks: ``setup`` (strategy check; wraps the module's ``on_load_checkpoint`` so that a resumed run resizes
    the model to the checkpoint's shapes before Lightning loads the weights; ``teardown`` restores it),
    ``on_train_start`` (captures the forward's input), ``on_before_optimizer_step`` (Taylor scores),
    ``on_train_batch_end`` (pruning events, after the optimizer step), ``state_dict``/``load_state_dict``.

    Args:
        amount: Final fraction of each prunable group's channels to remove, in ``[0, 1)``.
        importance: ``"l2"`` (norm of all weights attached to a channel) or ``"taylor"`` (Molchanov et al.,
            2019: ``(sum w * grad)**2`` per channel, accumulated since the previous event).
        schedule: When to prune (:class:`PruningSchedule`); events happen after the optimizer step of their step.
        ignore: Names of modules whose output channels are kept, as the LightningModule's ``named_modules()``
            gives them (e.g. ``"model.classifier"``); a name that is not a module is refused at setup.
        round_to: Keep channel counts at multiples of this (e.g. 8 for vectorized kernels) where possible.
        attention_heads: Replace each ``nn.MultiheadAttention`` (in ``nn.Transformer*Layer`` or anywhere) by the
            equivalent :class:`~lightning_bigtrain.functional.attention.HeadedAttention` at setup, so its heads can
            be removed (``nn.MultiheadAttention`` cannot run with fewer heads than its width implies). The swap is
            in the checkpoint: resuming and :func:`load_pruned` rebuild it.
    """

    def __init__(
        self,
        amount: float,
        *,
        importance: Importance = "l2",
        schedule: PruningSchedule | None = None,
        ignore: Sequence[str] = (),
        round_to: int = 1,
        attention_heads: bool = True,
    ) -> None:
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0.0 <= amount < 1.0:
            raise ValueError(
                f"StructuredPruning(amount={amount!r}): must be a fraction in [0, 1) of each layer's channels "
                "(0.5 removes half)."
            )
        if importance not in get_args(Importance):
            raise ValueError(f"StructuredPruning(importance={importance!r}): expected one of {get_args(Importance)}.")
        if round_to < 1:
            raise ValueError(f"StructuredPruning(round_to={round_to}): must be >= 1.")
        if not isinstance(attention_heads, bool):
            raise TypeError(
                f"StructuredPruning(attention_heads={attention_heads!r}): pass True (remove heads of "
                "nn.MultiheadAttention, swapped for HeadedAttention) or False (keep them)."
            )
        self.amount = float(amount)
        self.importance = importance
        self.schedule = schedule if schedule is not None else PruningSchedule()
        self.ignore = list(ignore)
        self.round_to = round_to
        self.attention_heads = attention_heads
        self.swapped: list[str] = []
        self.groups: list[Any] = []
        self._original: dict[int, int] = {}
        self._example: tuple[Any, ...] | None = None
        self._example_kwargs: dict[str, Any] = {}
        self._target = ""  # the submodule traced ("" for the LightningModule itself)
        self._calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self._hooks: list[Any] = []
        self._taylor: dict[str, torch.Tensor] = {}
        self._steps: tuple[int, int, int] = (0, 0, 1)
        self._last_event = -1
        self._done = False
        self._module: nn.Module | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(amount=self.amount, importance=self.importance)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

        from lightning_bigtrain.strategies import CompressedDDPStrategy

        strategy = trainer.strategy
        if isinstance(strategy, (CompressedDDPStrategy, DeepSpeedStrategy)) or not isinstance(
            strategy, (DDPStrategy, SingleDeviceStrategy)
        ):
            raise ValueError(
                f"StructuredPruning changes layer shapes mid-training, which {type(strategy).__name__} cannot follow "
                "(its shards, buckets or compression state are laid out for the old shapes). Prune with "
                "strategy='ddp' or one device, then train the smaller model with any strategy."
            )
        averaging = [c for c in getattr(trainer, "callbacks", []) if _averages_weights(c)]
        if averaging:
            # The average is a copy of the module with its old shapes: WeightAveraging's update failed on a size
            # mismatch ("The size of tensor a (64) must match the size of tensor b (32)").
            raise ValueError(
                f"StructuredPruning with `{type(averaging[0]).__name__}`: the average is a copy of the module made "
                "before pruning, and pruning removes channels from the module mid-training, so the two no longer "
                "match. Prune in one fit, then average the smaller model's training in the next."
            )
        from lightning_bigtrain.functional.structured import check_module_names

        self._module = pl_module
        written = [name for name, _ in pl_module.named_modules(remove_duplicate=False)]
        if self.attention_heads:
            from lightning_bigtrain.functional.attention import swap_multihead_attention_

            self.swapped = swap_multihead_attention_(pl_module)  # before the optimizer holds the parameters
        # Names of the model as written or as swapped (HeadedAttention's q_proj/k_proj/v_proj) are both accepted.
        check_module_names(pl_module, self.ignore, f"StructuredPruning(ignore={self.ignore!r})", also=written)
        # Resuming from a pruned checkpoint: Lightning calls the module's `on_load_checkpoint` just before it loads
        # the weights (after this hook, before the strategy wraps the model), so the shapes are rebuilt there.
        original = pl_module.on_load_checkpoint

        def on_load_checkpoint(checkpoint: dict[str, Any]) -> None:
            if _STRUCTURE_KEY in checkpoint or _ATTENTION_KEY in checkpoint:
                from lightning_bigtrain.functional.structured import resize_to_state_dict_

                _swap_as_saved(pl_module, checkpoint)
                resize_to_state_dict_(pl_module, checkpoint["state_dict"])
            original(checkpoint)

        pl_module.on_load_checkpoint = on_load_checkpoint  # type: ignore[method-assign]

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._steps = self.schedule.resolve(trainer.estimated_stepping_batches)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        example = getattr(pl_module, "example_input_array", None)
        if example is not None:
            self._example = example if isinstance(example, tuple) else (example,)
            return

        def first_two(value: Any) -> Any:
            return value.detach()[:2] if isinstance(value, torch.Tensor) and value.ndim else value

        def capture(name: str) -> Any:
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                # Lightning calls the module with the training_step's arguments while `forward` is redirected to
                # training_step (so that DDP sees one forward); only calls of the real forward carry its input.
                if not name and getattr(module.forward, "__func__", None) is not type(module).forward:
                    return
                if name not in self._calls:
                    self._calls[name] = (tuple(first_two(a) for a in args),
                                         {k: first_two(v) for k, v in kwargs.items()})  # fmt: skip

            return hook

        # The model is traced on the input of its first training step: the LightningModule's own forward, or, for a
        # step that calls a submodule instead (`self.model(input_ids=..., labels=...)`, as Hugging Face users
        # write), that submodule's call.
        self._hooks = [pl_module.register_forward_pre_hook(capture(""), with_kwargs=True)]
        self._hooks += [child.register_forward_pre_hook(capture(name), with_kwargs=True)
                        for name, child in pl_module.named_children()]  # fmt: skip

    def _choose_example(self, pl_module: L.LightningModule) -> None:
        calls, self._calls = self._calls, {}
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if "" in calls:
            self._target, (self._example, self._example_kwargs) = "", calls[""]
        elif len(calls) == 1:
            self._target, (self._example, self._example_kwargs) = next(iter(calls.items()))
        elif calls:
            warn_once(
                f"StructuredPruning: training_step called {', '.join(f'`self.{n}`' for n in calls)} but not the "
                f"module's own forward; set `{type(pl_module).__name__}.example_input_array` to an input of its "
                "forward so the whole model can be traced.",
                NoEffectWarning,
            )

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.importance != "taylor" or self._done:
            return
        for name, p in pl_module.named_parameters():
            if p.grad is not None and p.ndim >= 1:
                score = (p.detach() * p.grad.detach()).float()
                previous = self._taylor.get(name)
                self._taylor[name] = score if previous is None or previous.shape != score.shape else previous + score

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._hooks:
            self._choose_example(pl_module)
        step = trainer.global_step - 1  # the optimizer step that just ran
        if self._done or step <= self._last_event or self._example is None:
            return
        start, end, frequency = self._steps
        final = step >= end
        if step < start or not (final or (step - start) % frequency == 0):
            return
        self._last_event = step
        amount = self.amount if final else cubic_sparsity(step, final=self.amount, start=start, end=end,
                                                          initial=self.schedule.initial_sparsity)  # fmt: skip
        self._prune(trainer, pl_module, amount)
        if final:
            self._done = True
            self._taylor.clear()

    def _prune(self, trainer: L.Trainer, pl_module: L.LightningModule, amount: float) -> None:
        from lightning_bigtrain.functional.structured import (
            channel_groups,
            channel_importance,
            keep_indices,
            remove_channels_,
        )

        assert self._example is not None
        was_training = {m: m.training for m in pl_module.modules()}
        pl_module.eval()  # tracing runs the model: no BatchNorm statistics update, no dropout draws
        model = pl_module.get_submodule(self._target) if self._target else pl_module
        prefix = f"{self._target}." if self._target else ""
        ignore = [name[len(prefix) :] for name in self.ignore if name.startswith(prefix)]
        try:
            groups = channel_groups(model, self._example, ignore, example_kwargs=self._example_kwargs)
        finally:
            for m, mode in was_training.items():
                m.train(mode)
        if not self._original:
            self._original = {g.id: g.size for g in groups}
        if not self.groups:
            blocked = [g for g in groups if not g.prunable]
            if blocked:
                reasons = sorted({f"{g.slots[0].module} ({g.blocked[0] if g.blocked else 'no producer'})"
                                  for g in blocked})  # fmt: skip
                warn_once(
                    f"StructuredPruning keeps the channels of {len(blocked)} group(s) it cannot follow or must not "
                    f"change: {'; '.join(reasons[:12])}{' ...' if len(reasons) > 12 else ''}.",
                    BigtrainWarning,
                )
        self.groups = groups
        kept: dict[int, torch.Tensor] = {}
        for group in groups:
            if not group.prunable:
                continue
            original = self._original.get(group.id, group.size)
            target = max(1, original - math.floor(amount * original))
            if self.round_to > 1 and target >= self.round_to:
                target -= target % self.round_to
            if group.size <= target:
                continue
            taylor = {k[len(prefix) :]: v for k, v in self._taylor.items() if k.startswith(prefix)}
            scores = channel_importance(model, group, self.importance, taylor)
            kept[group.id] = keep_indices(scores, count=target)
        kept = trainer.strategy.broadcast(kept, src=0)  # every rank removes exactly rank 0's choice
        if not kept:
            return
        remove_channels_(model, groups, kept, trainer.optimizers)
        for group in groups:
            if group.id in kept:
                group.size = kept[group.id].numel()
        self._taylor.clear()
        self._rewrap(trainer)
        pl_module.log("pruning/params", float(sum(p.numel() for p in pl_module.parameters())), rank_zero_only=True)

    @staticmethod
    def _rewrap(trainer: L.Trainer) -> None:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = trainer.strategy
        if isinstance(strategy, DDPStrategy):
            assert strategy.lightning_module is not None
            rewrap_ddp(strategy)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.groups or self._last_event >= 0:
            # Whenever channels were removed, in this job or before its resume (a job resumed after the last
            # pruning event traces nothing, so `groups` stays empty): the next relaunch rebuilds these shapes.
            checkpoint[_STRUCTURE_KEY] = {name: tuple(t.shape) for name, t in checkpoint["state_dict"].items()}
        if self.swapped:
            checkpoint[_ATTENTION_KEY] = list(self.swapped)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_event": self._last_event, "done": self._done, "original": dict(self._original)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_event = int(state_dict.get("last_event", -1))
        self._done = bool(state_dict.get("done", False))
        self._original = {int(k): int(v) for k, v in state_dict.get("original", {}).items()}

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._example is None and not self._done:
            warn_once(
                "StructuredPruning removed nothing: the module's forward was never called during training, so the "
                f"model could not be traced. Set `{type(pl_module).__name__}.example_input_array` to an input of "
                "its forward.",
                NoEffectWarning,
            )

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if "on_load_checkpoint" in vars(pl_module):
            del pl_module.on_load_checkpoint  # the class's own hook again


def load_pruned(cls: type[L.LightningModule], checkpoint_path: str | Path, **kwargs: Any) -> L.LightningModule:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` for a checkpoint written after
    :class:`StructuredPruning` removed channels: the model is built from its saved hyperparameters, then resized
    to the checkpoint's shapes before the weights load."""
    from lightning_bigtrain.functional.structured import resize_to_state_dict_

    own = "on_load_checkpoint" in cls.__dict__
    original = cls.on_load_checkpoint

    def on_load_checkpoint(self: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        _swap_as_saved(self, checkpoint)
        resize_to_state_dict_(self, checkpoint["state_dict"])
        original(self, checkpoint)

    cls.on_load_checkpoint = on_load_checkpoint  # type: ignore[method-assign,assignment]
    try:
        return cls.load_from_checkpoint(checkpoint_path, **kwargs)
    finally:
        if own:
            cls.on_load_checkpoint = original  # type: ignore[method-assign]
        else:
            del cls.on_load_checkpoint
