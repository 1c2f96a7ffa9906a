"""MagnitudePruning: gradual unstructured and N:M pruning for any LightningModule, under any of our strategies."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from typing_extensions import override

from lightning_bigtrain.callbacks._pruning_schedule import PruningSchedule
from lightning_bigtrain.functional.pruning import (
    SparsityRow,
    check_nm_shape,
    cubic_sparsity,
    magnitude_scores,
    movement_update_,
    nm_mask,
    parse_nm,
    sparsity_masks,
    sparsity_rows,
)
from lightning_bigtrain.warnings import BigtrainWarning, NoEffectWarning, warn_once

__all__ = ["MagnitudePruning", "format_sparsity_table"]

Scope = Literal["global", "layer"]
Criterion = Literal["magnitude", "movement"]
_PRUNABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


_MHA_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def _is_hf_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2's projections): a linear layer whose weight is stored ``(in, out)``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def _input_last(module: nn.Module) -> bool:
    """Whether the layer's weight runs along its input dimension last (everything but Hugging Face's Conv1D)."""
    return not _is_hf_conv1d(module)


class MagnitudePruning(L.Callback):
    """Prune weights to a target sparsity during training; masks stay enforced after every optimizer step.

    Hooks: ``setup`` (chooses and validates the weights), ``on_fit_start`` (schedule in steps),
    ``on_train_batch_start`` (pruning events, rewind snapshot), ``on_before_optimizer_step`` (movement scores),
    ``on_train_batch_end`` (re-applies the masks after the optimizer step), ``state_dict``/``load_state_dict``
    (masks, scores, snapshot and schedule position: a resumed run continues exactly), ``on_train_end``
    (per-layer sparsity table in the log, ``sparsity.png`` in the logger's folder).

    Pruned weights are zeroed in place (no reparametrization: the module keeps plain parameters, so checkpoints
    load into the unpruned class, and DDP, CompressedDDPStrategy and ZeroStrategy stages 1-3 see ordinary
    weights). Every rank computes the same masks: replicated weights and gradients are identical after the
    gradient exchange, and sharded weights (ZeRO-3) get thresholds from counts all-reduced across ranks.
    Accuracy and speed against Lightning's ``ModelPruning``: the method card, ``docs/pruning.md``.

    Args:
        sparsity: Final fraction of the chosen weights set to zero, in ``[0, 1)``. With ``pattern`` it may be
            left out (it is ``1 - N/M``).
        scope: ``"global"`` ranks all chosen weights together (Zhu & Gupta; layers get different sparsities);
            ``"layer"`` prunes each weight tensor to ``sparsity``.
        schedule: When to prune; default :class:`PruningSchedule()` (cubic ramp from step 0 to 3/4 of the run).
            With ``pattern`` the masks are set once, at ``schedule.start``, and the rest of the run fine-tunes.
        pattern: ``"N:M"`` semi-structured sparsity (e.g. ``"2:4"``: 2 of every 4 consecutive weights along the
            input dimension kept).
        criterion: ``"magnitude"`` (``|w|``) or ``"movement"`` (Sanh et al., 2020: weights moving toward zero
            during fine-tuning are pruned; scores accumulate ``-grad * w`` every step).
        rewind: Lottery-ticket rewinding (Frankle et al., 2019, "Stabilizing the Lottery Ticket Hypothesis"):
            keep a copy of the weights at this step (int, or float fraction of the run) and, when the final
            masks are set, reset the surviving weights to it. The optimizer's state and the learning-rate
            schedule continue.
        parameters: Names of the parameters to prune (``fnmatch`` patterns such as ``"features.*.weight"``);
            default: the ``weight`` of every Linear and Conv layer (Hugging Face's ``Conv1D`` included) and the
            input projections of ``nn.MultiheadAttention``, except weights that are all zeros at setup
            (zero-initialized layers, named in a warning).
        plot: Save a per-layer sparsity bar chart (needs matplotlib) at the end of training.
    """

    def __init__(
        self,
        sparsity: float | None = None,
        *,
        scope: Scope = "global",
        schedule: PruningSchedule | None = None,
        pattern: str | None = None,
        criterion: Criterion = "magnitude",
        rewind: int | float | None = None,
        parameters: Sequence[str] | None = None,
        plot: bool = True,
    ) -> None:
        if scope not in get_args(Scope):
            raise ValueError(f"MagnitudePruning(scope={scope!r}): expected one of {get_args(Scope)}.")
        if criterion not in get_args(Criterion):
            raise ValueError(f"MagnitudePruning(criterion={criterion!r}): expected one of {get_args(Criterion)}.")
        self.nm = parse_nm(pattern) if pattern is not None else None
        if self.nm is not None:
            implied = 1.0 - self.nm[0] / self.nm[1]
            if sparsity is not None and abs(sparsity - implied) > 1e-9:
                raise ValueError(
                    f"MagnitudePruning(sparsity={sparsity}, pattern={pattern!r}): the pattern fixes the sparsity at "
                    f"{implied:g}; leave `sparsity` out or set it to {implied:g}."
                )
            sparsity = implied
        if sparsity is None:
            raise ValueError("MagnitudePruning: give `sparsity` (a fraction in [0, 1)) or an N:M `pattern`.")
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
            raise ValueError(
                f"MagnitudePruning(sparsity={sparsity!r}): must be a fraction in [0, 1) (0.9 keeps 10% of the "
                "weights); 1 would remove every weight."
            )
        if rewind is not None and (isinstance(rewind, bool) or (isinstance(rewind, float) and not 0 <= rewind <= 1)
                                   or (isinstance(rewind, int) and rewind < 0)):  # fmt: skip
            raise ValueError(f"MagnitudePruning(rewind={rewind!r}): a step (int >= 0) or a fraction of the run.")
        self.sparsity = float(sparsity)
        self.scope = scope
        self.schedule = schedule if schedule is not None else PruningSchedule()
        if self.schedule.initial_sparsity > self.sparsity:
            raise ValueError(
                f"PruningSchedule(initial_sparsity={self.schedule.initial_sparsity}) is above the final "
                f"sparsity {self.sparsity}."
            )
        self.pattern = pattern
        self.criterion = criterion
        self.rewind = rewind
        self.parameters = list(parameters) if parameters is not None else None
        self.plot = plot
        self.names: list[str] = []
        self._transposed: set[str] = set()
        self._masks: dict[str, torch.Tensor] = {}  # local (shard) masks, True keeps
        self._scores: dict[str, torch.Tensor] = {}  # movement scores (local)
        self._snapshot: dict[str, torch.Tensor] | None = None  # rewind copy (local)
        self._pending: dict[str, Any] | None = None  # checkpointed state, applied once parameters are placed
        self._steps: tuple[int, int, int] = (0, 0, 1)
        self._rewind_step: int | None = None
        self._last_event = -1
        self._current = 0.0
        self._done = False
        self._enforced_at = -1
        self._module: nn.Module | None = None
        self.report: list[SparsityRow] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(sparsity=self.sparsity, pattern=self.pattern, criterion=self.criterion)

    # ----------------------------------------------------------------------------------------------- set-up

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from lightning.pytorch.strategies import DeepSpeedStrategy

        strategy = getattr(trainer, "strategy", None)
        if isinstance(strategy, DeepSpeedStrategy):
            raise ValueError(
                f"MagnitudePruning cannot prune under {type(strategy).__name__}: DeepSpeed's engine steps "
                "its own fp32 copies of the weights and copies them back over the module's, so masks applied to "
                "the module would be undone silently. Use ZeroStrategy(engine='torch') (any stage), DDP or "
                "CompressedDDPStrategy."
            )
        stages = getattr(strategy, "pipeline_parallel", 1)
        if stages > 1:
            raise ValueError(
                f"MagnitudePruning cannot prune under ZeroStrategy(pipeline_parallel={stages}) "
                "yet: each stage holds part of the weights (and every stage the embeddings and head), so the "
                "global magnitude threshold would be taken over one stage's weights. Prune with tensor_parallel or "
                "ZeRO (any stage), DDP or CompressedDDPStrategy."
            )
        self.names = self._choose(pl_module)  # (validated here: bad names fail before anything is built)
        if any(p.is_meta for p in pl_module.parameters()):
            # Built on the meta device, materialized by the strategy after this hook: chosen again at fit start,
            # where a zero-initialized weight (torchvision ViT's head) shows as one.
            self.names = []
        if self.sparsity == 0.0:
            warn_once("MagnitudePruning(sparsity=0.0) prunes nothing; give a sparsity above 0.", NoEffectWarning)

    def _choose(self, module: nn.Module) -> list[str]:
        """Names of the parameters to prune: validated, each tensor once, frozen ones left out with a warning."""
        named = dict(module.named_parameters(remove_duplicate=False))
        if self.parameters is None:
            candidates = []
            for prefix, sub in module.named_modules(remove_duplicate=False):
                dot = f"{prefix}." if prefix else ""
                if (isinstance(sub, _PRUNABLE) or _is_hf_conv1d(sub)) and isinstance(
                    getattr(sub, "weight", None), nn.Parameter
                ):
                    candidates.append(f"{dot}weight")
                elif isinstance(sub, nn.MultiheadAttention):  # its input projections are bare parameters
                    candidates += [f"{dot}{n}" for n in _MHA_WEIGHTS if isinstance(getattr(sub, n, None), nn.Parameter)]
        else:
            candidates = []
            for pattern in self.parameters:
                hits = [name for name in named if fnmatch.fnmatchcase(name, pattern)]
                if not hits:
                    available = ", ".join(list(named)[:30]) + (" ..." if len(named) > 30 else "")
                    raise ValueError(
                        f"MagnitudePruning(parameters=[{pattern!r}, ...]): no parameter of "
                        f"{type(module).__name__} matches {pattern!r}. Parameters: {available}"
                    )
                candidates += hits
        chosen: list[str] = []
        seen: set[int] = set()
        frozen: list[str] = []
        zeros: list[str] = []
        for name in candidates:
            param = named[name]
            if id(param) in seen:
                continue
            seen.add(id(param))
            if not param.requires_grad:
                frozen.append(name)
                continue
            if self.parameters is None and not param.is_meta and param.numel() and _all_zero(param):
                # Zero-initialized (torchvision's ViT head): it ranks below every trained weight, would be masked whole
                # at the first event and stay zero for good.
                zeros.append(name)
                continue
            aliases = [other for other, p in named.items() if p is param and other != name]
            if aliases:
                warn_once(
                    f"MagnitudePruning: `{name}` is shared with {', '.join(f'`{a}`' for a in aliases)} (tied weights); "
                    "it is pruned once and its mask applies to every use.",
                    BigtrainWarning,
                )
            chosen.append(name)
        if zeros:
            warn_once(
                f"MagnitudePruning: {', '.join(f'`{z}`' for z in zeros)} all zeros at setup (zero-initialized): left "
                "dense, since magnitude ranking would mask it whole before it trains. Name it in `parameters=[...]` "
                "to prune it anyway.",
                BigtrainWarning,
            )
        if frozen:
            warn_once(
                f"MagnitudePruning: {len(frozen)} frozen parameter(s) left unpruned (they do not train, so their "
                f"accuracy could not recover): {', '.join(frozen)}. Unfreeze them to prune them.",
                BigtrainWarning,
            )
        if not chosen:
            raise ValueError(
                f"MagnitudePruning: {type(module).__name__} has no trainable Linear/Conv weight to prune; name the "
                "parameters with `parameters=[...]`."
            )
        owners = dict(module.named_modules(remove_duplicate=False))
        self._transposed = {name for name in chosen if not _input_last(owners.get(name.rpartition(".")[0], module))}
        if self.nm is not None:
            bad = [
                f"{name} {tuple(named[name].shape)} ({reason})"
                for name in chosen
                if (reason := check_nm_shape(self._input_last_shape(name, named[name]), self.nm[1])) is not None
            ]
            if bad and self.parameters is not None:
                raise ValueError(
                    f"MagnitudePruning(pattern={self.pattern!r}) cannot apply to: {'; '.join(bad)}. Leave these out "
                    "with `parameters=[...]`."
                )
            if bad:
                # The default choice: layers whose shape cannot take the pattern (a depthwise 7x7 convolution, a
                # layer of odd width) stay dense, as sparse kernels would skip them too.
                fits = [n for n in chosen if check_nm_shape(self._input_last_shape(n, named[n]), self.nm[1]) is None]
                if not fits:
                    raise ValueError(
                        f"MagnitudePruning(pattern={self.pattern!r}): no weight of {type(module).__name__} can take "
                        f"the pattern: {'; '.join(bad[:5])}."
                    )
                warn_once(
                    f"MagnitudePruning(pattern={self.pattern!r}) leaves {len(bad)} weight(s) dense whose shape "
                    f"cannot take it: {'; '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}.",
                    BigtrainWarning,
                )
                chosen = fits
        return chosen

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.names:
            self.names = self._choose(pl_module)
        self._module = pl_module
        total = trainer.estimated_stepping_batches
        self._steps = self.schedule.resolve(total)
        if self.rewind is not None:
            self._rewind_step = round(self.rewind * total) if isinstance(self.rewind, float) else self.rewind
            if self._rewind_step > self._steps[1]:
                raise ValueError(
                    f"MagnitudePruning(rewind={self.rewind}): the snapshot (step {self._rewind_step}) must come "
                    f"before the final masks are set (step {self._steps[1]})."
                )
        if self.criterion == "movement":
            strategy = trainer.strategy
            stage = getattr(strategy, "stage", None)
            if stage in (1, 2) and getattr(strategy, "_flat_engine", False):
                raise ValueError(
                    "MagnitudePruning(criterion='movement') reads every weight's averaged gradient, which "
                    f"ZeroStrategy(stage={stage}) does not keep (its flat buckets are reduce-scattered: each rank "
                    "holds only its own slice averaged). Use stage 3 or DDP, or criterion='magnitude'."
                )

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # After on_fit_start: Lightning restores callback state between the two.
        params = self._params(pl_module)
        if self._pending is not None:
            self._restore(params)
        self._mask_averages(trainer)
        if self.criterion == "movement":
            for name, p in params.items():
                self._scores.setdefault(name, torch.zeros_like(_local(p), dtype=torch.float32))

    # ------------------------------------------------------------------------------------------- training

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        step = trainer.global_step
        if self._done or step <= self._last_event:
            return
        params = self._params(pl_module)
        if self._rewind_step is not None and self._snapshot is None and step >= self._rewind_step:
            self._snapshot = {name: _local(p).detach().clone() for name, p in params.items()}
        start, end, frequency = self._steps
        final = step >= end or self.nm is not None  # N:M masks are set once, at `start`
        if step < start or not (final or (step - start) % frequency == 0):
            return
        self._last_event = step
        if final:
            target = self.sparsity
        else:
            target = cubic_sparsity(step, final=self.sparsity, start=start, end=end,
                                    initial=self.schedule.initial_sparsity)  # fmt: skip
        if target > self._current or final:
            self._prune(params, target)
            self._current = target
        if final:
            self._done = True
            if self._snapshot is not None:
                with torch.no_grad():
                    for name, p in params.items():
                        _local(p).copy_(self._snapshot[name] * self._masks[name])
                self._snapshot = None

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.criterion != "movement" or self._done:
            return
        for name, p in self._params(pl_module).items():
            if p.grad is not None:
                movement_update_(self._scores[name], _local(p), _local(p.grad))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        pl_module.log("pruning/sparsity", self._current, rank_zero_only=True)
        if not self._masks or trainer.global_step == self._enforced_at:
            return
        self._enforced_at = trainer.global_step
        self._apply(self._params(pl_module))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        params = self._params(pl_module)
        self.report = sparsity_rows([(name, _full(p.detach())) for name, p in params.items()])
        if trainer.is_global_zero:
            rank_zero_info(format_sparsity_table(self.report))
            if self.plot:
                self._save_plot(trainer)

    def _mask_averages(self, trainer: L.Trainer) -> None:
        """Lightning's weight averaging keeps a copy of the module that it updates from the module's weights and
        copies back at the end of fit (and swaps in around validation). The masks were not applied to it: the
        average of weights pruned at some point is not zero there, and the pruned model came out of fit dense
        (sparsity 0.0), silently. Each ``WeightAveraging`` update is now followed by the masks, and SWA's transfer
        into the module too."""
        from lightning.pytorch.callbacks import StochasticWeightAveraging

        from lightning_bigtrain._compat import weight_averaging_callbacks

        for callback in weight_averaging_callbacks(trainer):
            average = callback._average_model
            if getattr(average, "_bigtrain_masked", None) is self:
                continue
            update = average.update_parameters

            def masked_update(model: nn.Module, update: Any = update, average: Any = average) -> None:
                update(model)
                if self._masks:
                    self._apply(self._params(average.module))

            average.update_parameters = masked_update
            average._bigtrain_masked = self
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if (
                isinstance(callback, StochasticWeightAveraging)
                and getattr(callback, "_bigtrain_masked", None) is not self
            ):
                transfer = callback.transfer_weights

                def masked_transfer(src: nn.Module, dst: nn.Module, transfer: Any = transfer) -> None:
                    transfer(src, dst)
                    if self._masks:
                        self._apply(self._params(dst))

                callback.transfer_weights = masked_transfer  # type: ignore[method-assign,assignment]
                callback._bigtrain_masked = self  # type: ignore[attr-defined]

    def make_permanent(self) -> list[SparsityRow]:
        """Stop enforcing the masks (the pruned weights stay zero; further training may revive them) and
        return the per-layer report. Use after fit, before exporting or further dense training."""
        self._masks.clear()
        self._scores.clear()
        self._snapshot = None
        self._done = True
        return self.report

    # ----------------------------------------------------------------------------------------- mechanics

    def _input_last_shape(self, name: str, param: torch.Tensor) -> tuple[int, ...]:
        shape = tuple(param.shape)
        return (shape[1], shape[0]) if name in self._transposed and len(shape) == 2 else shape

    def _params(self, module: nn.Module) -> dict[str, torch.Tensor]:
        named = dict(module.named_parameters(remove_duplicate=False))
        return {name: named[name] for name in self.names}

    def _prune(self, params: dict[str, torch.Tensor], sparsity: float) -> None:
        locals_ = {name: _local(p) for name, p in params.items()}
        if self.criterion == "movement":
            scores = [self._scores[name].masked_fill(~self._masks[name], -math.inf) if name in self._masks
                      else self._scores[name].clone() for name in params]  # fmt: skip
        else:
            scores = [magnitude_scores(locals_[name], self._masks.get(name)) for name in params]
        if self.nm is not None:
            # N:M groups run along the input dimension: Hugging Face's Conv1D stores it first.
            masks = [nm_mask(s.t(), *self.nm).t() if name in self._transposed else nm_mask(s, *self.nm)
                     for name, s in zip(params, scores, strict=True)]  # fmt: skip
        else:
            sharded = [isinstance(p, DTensor) for p in params.values()]
            group = None
            if any(sharded):
                first = next(p for p in params.values() if isinstance(p, DTensor))
                group = first.device_mesh.get_group()
            masks = sparsity_masks(scores, sparsity, scope=self.scope, numels=[p.numel() for p in params.values()],
                                   group=group, sharded=any(sharded))  # fmt: skip
        self._masks = dict(zip(params, masks, strict=True))
        self._apply(params)

    @torch.no_grad()
    def _apply(self, params: dict[str, torch.Tensor]) -> None:
        for name, p in params.items():
            _local(p).mul_(self._masks[name].to(_local(p).dtype))

    # ---------------------------------------------------------------------------------------- checkpoint

    @override
    def state_dict(self) -> dict[str, Any]:
        module = self._module
        state: dict[str, Any] = {
            "names": list(self.names),
            "last_event": self._last_event,
            "current": self._current,
            "done": self._done,
        }
        if module is None:
            return state
        params = self._params(module)
        state["masks"] = {n: _full_like(params[n], m.to(torch.uint8)).bool() for n, m in self._masks.items()}
        state["scores"] = {n: _full_like(params[n], s) for n, s in self._scores.items()}
        if self._snapshot is not None:
            state["snapshot"] = {n: _full_like(params[n], s) for n, s in self._snapshot.items()}
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = dict(state_dict)

    def _restore(self, params: dict[str, torch.Tensor]) -> None:
        state, self._pending = self._pending, None
        assert state is not None
        if state.get("names") and list(state["names"]) != self.names:
            raise ValueError(
                "MagnitudePruning: the checkpoint pruned other parameters "
                f"({', '.join(state['names'][:5])}...) than this run chose ({', '.join(self.names[:5])}...). "
                "Resume with the same model and `parameters=`."
            )
        self._last_event = int(state.get("last_event", -1))
        self._current = float(state.get("current", 0.0))
        self._done = bool(state.get("done", False))
        self._enforced_at = -1
        self._masks = {n: _shard_like(params[n], m).bool() for n, m in state.get("masks", {}).items()}
        self._scores = {n: _shard_like(params[n], s) for n, s in state.get("scores", {}).items()}
        if "snapshot" in state:
            self._snapshot = {n: _shard_like(params[n], s) for n, s in state["snapshot"].items()}
        if self._masks:
            self._apply(params)

    # -------------------------------------------------------------------------------------------- report

    def _save_plot(self, trainer: L.Trainer) -> Path | None:
        folder = getattr(trainer.logger, "log_dir", None) or trainer.default_root_dir
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            warn_once("MagnitudePruning(plot=True): matplotlib is not installed; no sparsity plot.", NoEffectWarning)
            return None
        path = Path(folder) / "sparsity.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * len(self.report) + 2), 3.5))
        ax.bar(range(len(self.report)), [100 * row.sparsity for row in self.report])
        ax.set_xticks(range(len(self.report)), [row.name for row in self.report], rotation=75, fontsize=7)
        ax.set_ylabel("sparsity (%)")
        ax.set_ylim(0, 100)
        ax.set_title("MagnitudePruning: zeros per layer")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def format_sparsity_table(rows: Sequence[SparsityRow]) -> str:
    """A plain-text per-layer sparsity table, with the total on the last line."""
    width = max([len(r.name) for r in rows] + [5])
    lines = [f"{'layer':<{width}}  {'shape':>18}  {'params':>10}  {'zeros':>10}  sparsity"]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.shape!s:>18}  {r.numel:>10,}  {r.zeros:>10,}  {r.sparsity:8.2%}")
    numel, zeros = sum(r.numel for r in rows), sum(r.zeros for r in rows)
    lines.append(f"{'total':<{width}}  {'':>18}  {numel:>10,}  {zeros:>10,}  {zeros / max(numel, 1):8.2%}")
    return "\n".join(lines)


def _all_zero(param: torch.Tensor) -> bool:
    """Whether every element is zero; a sharded parameter judged over all its shards (the same answer on every
    rank, though some hold an empty shard)."""
    nonzero = _local(param).detach().any()
    if isinstance(param, DTensor):
        flag = nonzero.to(torch.float32).reshape(1)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return not bool(flag.item())
    return not bool(nonzero)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _full_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which ``local`` is this rank's shard laid out as ``param`` (collective if sharded)."""
    if not isinstance(param, DTensor):
        return local.detach().cpu().clone()
    whole = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                               shape=param.shape, stride=param.stride())  # fmt: skip
    return whole.full_tensor().cpu()


def _shard_like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's shard of the whole tensor ``full`` laid out as ``param`` (no communication)."""
    device = _local(param).device
    if not isinstance(param, DTensor):
        return full.to(device)
    return distribute_tensor(full.to(device), param.device_mesh, param.placements, src_data_rank=None).to_local()
