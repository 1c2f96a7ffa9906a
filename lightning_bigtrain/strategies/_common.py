"""What both ZeRO engines share: step-seeded RNG with the run's seeds in checkpoints, per-rank state logging."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_bigtrain._compat import StrategyMixinBase
from lightning_bigtrain.functional.materialize import Materialized
from lightning_bigtrain.functional.memory import set_mmap_threshold
from lightning_bigtrain.functional.rng import fold_seed, seed_all_
from lightning_bigtrain.warnings import BigtrainWarning, NoEffectWarning, warn_once

RNG_KEY = "bigtrain_rng"


class ZeroCommon(StrategyMixinBase):
    """Mixed into a Lightning ``ParallelStrategy`` with ``options: ZeroOptions`` and ``memory: dict``."""

    _rng_seed: int | None = None
    #: A model built on the meta device: what materializing it at setup could not initialize as the model would
    #: have (:class:`~lightning_bigtrain.functional.materialize.Materialized`, on this rank); None for a model
    #: built on a real device.
    materialized: Materialized | None = None

    def _report_unwritten(self, done: Materialized, who: str) -> None:
        """After materializing a meta-device model (kept as :attr:`materialized`): refuse a non-persistent buffer no
        initializer wrote (no checkpoint restores it); name the other unwritten tensors in a warning (a checkpoint
        loaded next fills them), those whose constructor's initialization could not be replayed, and those the
        constructor left uninitialized."""
        self.materialized = done
        left, not_replayed, uninitialized = done
        outside = (
            "Build the model under `trainer.init_module(empty_init=True)` or in `configure_model()`, where the "
            "strategy records how each tensor is initialized (not under a `torch.device('meta')` of your own "
            "before the Trainer runs)"
        )
        if not_replayed:
            warn_once(
                f"`{who}` materialized a model built on the meta device, and could not replay how its constructor "
                f"initialized {_listed(not_replayed)}: from meta tensors made before recording began, which hold no "
                "values. `reset_parameters()` initialized them instead, where their module has one. " + outside + ", "
                "or build those values from real tensors.",
                BigtrainWarning,
            )
        lost = [name for name, restorable in left if not restorable]
        if lost:
            raise ValueError(
                f"`{who}` materialized a model built on the meta device, and no initializer wrote "
                f"{', '.join(f'`{n}`' for n in lost)}: a non-persistent buffer or a tensor held as an attribute, "
                "which no checkpoint restores, so "
                f"training would read uninitialized memory. {outside}; or give its module a `reset_parameters()` "
                "that fills it; or build the model on a real device."
            )
        if left:
            warn_once(
                f"`{who}` materialized a model built on the meta device; no initializer wrote "
                f"{_listed([n for n, _ in left])} (not recorded, by a module with no `reset_parameters()`, outside any "
                "Hugging Face `_init_weights`). They hold uninitialized memory until a checkpoint is loaded "
                f"(`ckpt_path=...`). If the run starts from scratch: {outside[0].lower()}{outside[1:]}, or give those "
                "modules a `reset_parameters()`.",
                BigtrainWarning,
            )
        if uninitialized:
            warn_once(
                f"`{who}` materialized a model built on the meta device; its constructor left "
                f"{_listed(uninitialized)} uninitialized (`torch.empty`, nothing written after), as an eager build "
                "does. They hold NaN (integers: their minimum) until the model writes them.",
                BigtrainWarning,
            )

    def _fix_host_allocator(self, states_on_host: bool) -> None:
        """``ZeroOptions(host_mmap_threshold=...)``: when the sharded states live in host memory, keep glibc from
        holding freed step buffers in its heap (see the option)."""
        threshold = getattr(self, "options").host_mmap_threshold  # noqa: B009 (the host strategy's ZeroOptions)
        if states_on_host and threshold is not None and not set_mmap_threshold(threshold):
            warn_once(
                f"`ZeroOptions(host_mmap_threshold={threshold})` has no effect here: it sets glibc's mmap threshold, "
                "and this process's C library is not glibc on Linux. Pass host_mmap_threshold=None to silence this.",
                NoEffectWarning,
            )

    @classmethod
    def _register_stages(cls, registry: Any, prefix: str, engine: str) -> None:
        """``{prefix}1/2/3`` and ``{prefix}2_offload/3_offload`` (stage 3 offloads parameters too)."""
        for stage in (1, 2, 3):
            description = f"lightning_bigtrain ZeRO stage {stage}{engine}"
            registry.register(f"{prefix}{stage}", cls, description=description, override=True, stage=stage)
            if stage > 1:
                registry.register(
                    f"{prefix}{stage}_offload",
                    cls,
                    description=f"{description} with CPU offload",
                    override=True,
                    stage=stage,
                    offload_optimizer=True,
                    offload_params=stage == 3,
                )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Re-seed every generator from the run's seed and the batch index (exact resume with dropout)."""
        if not self.options.step_seeded_rng or self._rng_seed is None:  # type: ignore[attr-defined]
            return
        assert self.lightning_module is not None
        trainer = self.lightning_module.trainer
        seed_all_(fold_seed(self._rng_seed, trainer.fit_loop.epoch_loop.total_batch_idx))

    def _broadcast_buffers(self) -> None:
        """Copy rank 0's floating-point buffers (BatchNorm statistics) to every rank, in one broadcast."""
        for live, value in self._rank0_buffers().values():
            live.copy_(value)

    def _end_with_rank0_buffers(self) -> None:
        """At the end of training (``on_train_end``, every rank): rank 0's buffers on every rank, as each step's start
        puts them. Otherwise a run's replicas end on their own last updates, while a run relaunched after its last
        checkpoint (which holds one copy, rank 0's) ends on rank 0's: the same run would end in two states."""
        options = getattr(self, "options")  # noqa: B009 (the host strategy's options)
        if options.broadcast_buffers and self.world_size > 1 and getattr(self, "_pipeline", None) is None:
            self._broadcast_buffers()

    def _rank0_buffers(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Rank 0's floating-point buffers, in one broadcast (a collective): ``name -> (this rank's buffer, rank 0's
        value)``. The module is left as it is."""
        model = self.model
        assert model is not None
        buffers = [(name, b) for name, b in model.named_buffers() if b.is_floating_point()]
        if not buffers:
            return {}
        flat = torch.cat([b.detach().reshape(-1) for _, b in buffers])
        torch.distributed.broadcast(flat, src=0)
        out, offset = {}, 0
        for name, b in buffers:
            out[name] = (b, flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
        return out

    def _rng_state(self) -> dict[str, Any]:
        """Every rank's run seed (ranks may have been seeded differently)."""
        seeds: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(seeds, self._rng_seed)
        return {"seeds": seeds}

    def _restore_rng_state(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(RNG_KEY)
        if state and state["seeds"][0] is not None:
            # At another world size, ranks beyond the saved ones continue the saved ranks' streams in turn.
            self._rng_seed = int(state["seeds"][self.global_rank % len(state["seeds"])])

    def _closure_counting_state(self, closure: Any, count: Any) -> Any:
        """``closure``, followed by ``count()`` in the second step only (after backward and before the update:
        gradients are present and the optimizer states exist, optimizers creating them in their first step)."""
        module = self.lightning_module
        if self.memory or module is None or module.trainer.global_step < 1:
            return closure

        def closure_then_count() -> Any:
            result = closure()
            count()
            return result

        return closure_then_count

    def _log_state_bytes(self, local: dict[str, int]) -> None:
        """Keep this rank's model-state bytes in ``memory``; gather every rank's and log them on rank 0
        (``zero/rank{r}_{params,grads,optimizer}_bytes``, and ``_compression_bytes`` where a compressor keeps
        per-rank state)."""
        self.memory = local
        names = ("params", "grads", "optimizer") + (("compression",) if "compression" in local else ())
        values = torch.tensor([local[name] for name in names], dtype=torch.float64)
        gathered = self.all_gather(values.to(self.root_device)).reshape(-1, len(names)).cpu()
        module = self.lightning_module
        if module is None or not self.is_global_zero:
            return
        trainer = module.trainer
        metrics = {
            f"zero/rank{rank}_{name}_bytes": value
            for rank, row in enumerate(gathered.tolist())
            for name, value in zip(names, row, strict=True)
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def _listed(names: list[str], most: int = 8) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def refuse_sparse_gradients(module: Any, who: str, instead: str) -> None:
    """Refuse a module whose embeddings make sparse gradients (``nn.Embedding(sparse=True)``,
    ``nn.EmbeddingBag(sparse=True)``) under a layout that reduces gradients through flat or sharded buffers, which
    sparse tensors cannot enter (it failed at the first backward, deep in torch or DeepSpeed: "reshape is not
    implemented for sparse tensors", "Could not run 'fsdp::chunk_cat' ... 'SparseCPU'")."""
    from torch import nn

    if module is None:
        return
    sparse = [name for name, m in module.named_modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse]
    if sparse:
        raise ValueError(
            f"`{who}` cannot reduce the sparse gradients of {_listed(sparse)} (`sparse=True` embeddings): its gradient "
            f"buffers are dense. Make them dense (`sparse=False`; a dense gradient of the table), or use {instead}."
        )


#: The hooks where a LightningModule reads or clips its gradients itself (``training_step``: manual optimization).
_GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step",
                   "training_step")  # fmt: skip
#: torch's functions over ``param.grad`` that need every gradient whole on every rank (a norm), and those that need
#: them present (element-wise: right on each rank's part).
_NORM_FUNCTIONS = ("clip_grad_norm_", "get_total_norm")
_ELEMENTWISE_FUNCTIONS = ("clip_grad_value_",)


def _names_used(code: Any) -> set[str]:
    """The global and attribute names ``code`` and the functions defined in it refer to (``co_names``)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_used(const)
    return names


def _is_lightnings_grad_norm(value: Any) -> bool:
    module = getattr(value, "__module__", None) or ""
    return getattr(value, "__name__", None) == "grad_norm" and module.startswith(("lightning.", "pytorch_lightning."))


def warn_own_gradient_reads(module: Any, who: str, what_grad_holds: str, absent: bool) -> None:
    """Warn (once, on rank 0) where the module's own hooks clip or measure ``param.grad`` with torch's functions
    (``torch.nn.utils.clip_grad_norm_``, ``get_total_norm``; with ``absent``, when the gradients are None there, also
    ``clip_grad_value_``) or Lightning's ``grad_norm``, under a layout whose module gradients are not the averaged
    gradients the optimizer applies (``what_grad_holds`` says what they are): there the clip silently clips by
    another norm, or nothing, and the logged norms are other numbers. Found from the
    names the overridden hooks' code refers to (no source needed: notebooks too); a call inside a helper method the
    hooks call is not seen. Lightning's own clipping (``gradient_clip_val``, ``self.clip_gradients``) is right there."""
    import contextlib
    import inspect

    from lightning.pytorch.utilities.model_helpers import is_overridden

    if module is None:
        return
    found: list[str] = []
    for hook in _GRADIENT_HOOKS:
        if not is_overridden(hook, module):
            continue
        fn = inspect.unwrap(getattr(type(module), hook))  # (under a decorator: ``@torch.no_grad()``)
        code = getattr(fn, "__code__", None)
        if code is None:
            continue
        names = _names_used(code)
        # A name of torch's functions, or any name bound to one (or to Lightning's ``grad_norm``) in the hook's module.
        scope = dict(getattr(fn, "__globals__", {}))
        cells = zip(code.co_freevars, getattr(fn, "__closure__", None) or (), strict=False)
        for name, cell in cells:
            with contextlib.suppress(ValueError):  # (an empty cell)
                scope[name] = cell.cell_contents
        bound = {name: scope.get(name) for name in names | set(code.co_freevars)}
        resolved = {getattr(v, "__name__", None) for v in bound.values() if callable(v)} | names
        functions = _NORM_FUNCTIONS + (_ELEMENTWISE_FUNCTIONS if absent else ())
        called = [f"`{name}`" for name in functions if name in resolved]
        if any(_is_lightnings_grad_norm(v) for v in bound.values()):
            called.append("Lightning's `grad_norm`")
        if called:
            found.append(f"`{type(module).__name__}.{hook}` uses {', '.join(called)}")
    if found:
        warn_once(
            f"{'; '.join(found)}: under `{who}` the module's `param.grad` is {what_grad_holds}, not the averaged "
            "gradient the optimizer applies, so torch's clipping there clips by another norm or not at all and the "
            "norms it logs are other numbers. Clip with `Trainer(gradient_clip_val=...)` or "
            "`self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm=...)` (by the global "
            "norm over every rank here), and log norms with `lightning_bigtrain.utilities.grad_norm`.",
            NoEffectWarning,
        )


def apply_layer_sync(strategy: Any, who: str) -> None:
    """``Trainer(sync_batchnorm=True)`` (or a ``LayerSync`` plugin) applied to the module when fitting, before it is
    sharded or wrapped, as Lightning's DDP and FSDP apply it: Lightning's ``ModelParallelStrategy`` and
    ``DeepSpeedStrategy``, which these strategies build on, ignored it, so the batch statistics stayed per rank,
    silently. On CPU ranks torch's GPU-only ``nn.SyncBatchNorm`` is replaced by ``GlooSyncBatchNorm``'s layer. The
    layers stay synchronized after fit (in evaluation they are plain batch normalization; checkpoints keep the keys)."""
    from lightning_bigtrain.plugins.layer_sync import layer_sync_for

    sync = layer_sync_for(strategy._layer_sync, strategy.root_device.type)
    strategy._layer_sync = sync
    if sync is None:
        return
    split = getattr(strategy, "tensor_parallel", 1) > 1 or getattr(strategy, "pipeline_parallel", 1) > 1
    if split:
        raise ValueError(
            f"`Trainer(sync_batchnorm=True)` under `{who}` with tensor or pipeline parallelism: the ranks of a "
            "tensor-parallel group see the same samples and a pipeline's stages hold different layers, so the "
            "statistics cannot be synchronized over the world. Use data parallelism alone (stages 1-3), or leave it "
            "off."
        )
    strategy.model = sync.apply(strategy.model)
