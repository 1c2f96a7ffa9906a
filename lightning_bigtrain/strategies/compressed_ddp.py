"""CompressedDDPStrategy: DDP whose gradient all-reduce is replaced by a compressed exchange, on CPU
(gloo) and GPU (NCCL)."""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

import lightning.pytorch as L
import torch
import torch.distributed
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_bigtrain.engines.auto_compression import AutoCompression
from lightning_bigtrain.engines.compression import GradientCompression, NodeGroups
from lightning_bigtrain.engines.onebit_adam import CompressedMomentumAdam, OneBitAdam, phase_hook
from lightning_bigtrain.functional.activation_checkpoint import (
    ActivationCheckpointing,
    check_activation_checkpointing,
    checkpoint_blocks_,
)
from lightning_bigtrain.functional.compression import COMPRESSION_NAMES, Compressor, Quantize
from lightning_bigtrain.plugins.layer_sync import layer_sync_for
from lightning_bigtrain.strategies._common import refuse_sparse_gradients
from lightning_bigtrain.strategies._compression import (
    CHECKPOINT_KEY,
    CompressionSupport,
    compression_applies,
    resolve_compression,
)
from lightning_bigtrain.strategies._fault import FaultTolerantStrategyMixin
from lightning_bigtrain.strategies._trainable import TrainableWatch
from lightning_bigtrain.warnings import NoEffectWarning, warn_once

if TYPE_CHECKING:
    from lightning_bigtrain._compat import _StrategyRegistry

__all__ = ["CompressedDDPStrategy"]

_REGISTERED = {f"bigtrain_ddp_{name}": name for name in COMPRESSION_NAMES}
_OWN_HOOK_ARGS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


def _compressed_hook(engine: GradientCompression, bucket: Any) -> Any:
    """DDP comm hook: average the bucket through the engine (its buffer lays the parameters out in order)."""
    buffer = bucket.buffer()
    return engine.exchange(buffer, engine.segments(buffer, bucket.parameters()))


# DDP checks the hook's annotations as objects, which `from __future__ import annotations` turns into strings.
_compressed_hook.__annotations__ = {
    "engine": GradientCompression,
    "bucket": torch.distributed.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


class CompressedDDPStrategy(FaultTolerantStrategyMixin, DDPStrategy):
    """Data parallelism with compressed gradient exchange, for any LightningModule.

    Registers a DDP communication hook that hands each gradient bucket to a
    :class:`~lightning_bigtrain.engines.compression.GradientCompression` engine (error feedback,
    PowerSGD factors, warm-up, byte counters). Unlike Lightning's ``DDPStrategy(ddp_comm_hook=...)``,
    which registers hooks on CUDA only and drops them silently elsewhere, the hook is registered on every
    device, gloo included. Replicas stay identical: every rank rebuilds the same average.

    Each rank's error-feedback buffers and the PowerSGD factors are saved in checkpoints (key
    ``"bigtrain_compression"``) and restored, so a resumed run continues on the same trajectory.
    Logged every ``log_every_n_steps``: ``compression/sent_bytes_per_step`` (ring-equivalent bytes this rank
    sent), ``compression/dense_bytes_per_step`` (what an fp32 all-reduce would send) and
    ``compression/ratio``.

    Registered as ``bigtrain_ddp_powersgd``, ``bigtrain_ddp_topk``, ``bigtrain_ddp_onebit``,
    ``bigtrain_ddp_int8``, ``bigtrain_ddp_fp16`` and ``bigtrain_ddp_auto``.

    With ``compression="auto"`` (:class:`~lightning_bigtrain.engines.auto_compression.AutoCompression`) the first
    optimizer steps are timed trials of a dense 16-bit all-reduce and of PowerSGD on the run's own link, and the
    ranks keep the faster (dense unless PowerSGD is clearly faster); the choice is logged
    (``compression/auto_choice``: the candidate's index) and checkpointed.

    Acts in: ``configure_ddp`` (hook registration), ``on_train_batch_start`` (DDP rebuilt when parameters changed
    ``requires_grad`` since it was built, e.g. a backbone unfrozen by ``BackboneFinetuning``: Lightning's DDP trains
    such a parameter unreduced, each rank on its own data), ``optimizer_step`` (step count, logging),
    ``save_checkpoint`` / ``load_checkpoint`` (compression state), ``teardown``.

    With ``compression=OneBitAdam(...)`` it is 1-bit Adam instead (Tang et al., 2021;
    :mod:`lightning_bigtrain.engines.onebit_adam`): the module's ``Adam`` / ``AdamW`` is stepped as
    :class:`~lightning_bigtrain.engines.onebit_adam.CompressedMomentumAdam` (same parameter groups), gradients are
    all-reduced densely for the warm-up, then not at all: the momentum is exchanged compressed with error feedback
    and the variance stays frozen. Registered as ``bigtrain_ddp_onebit_adam``. ``"16-mixed"`` is refused (a
    per-rank overflow would split the ranks' steps); ``"bf16-mixed"`` and fp32 run.

    Args:
        compression: A compressor (``PowerSGD(rank=4)``, ``TopK(0.01)``, ``OneBit()``, ``Quantize(8)``,
            ``Cast("fp16")``, ...) or one of the names ``"powersgd"``, ``"topk"``, ``"onebit"``,
            ``"int8"``, ``"int4"``, ``"fp16"``, ``"bf16"``; ``"auto"`` / ``AutoCompression(...)`` (the exchange
            picked by timing the first steps); or ``OneBitAdam(...)`` (compressed momentum).
        hierarchical: With ``num_nodes > 1`` and several devices per node: average densely within each node, then
            compress only across nodes, each parameter sent by one rank of its node
            (:class:`~lightning_bigtrain.engines.compression.NodeGroups`), so one compressed copy of the gradients
            per node crosses the inter-node link instead of one per rank, and the compressor's error acts on the
            node's mean. ``None`` (default): hierarchical wherever it applies (several nodes of several devices,
            and a gradient compressor; ``OneBitAdam`` exchanges its momentum flat). ``False``: every rank in one
            flat compressed exchange. Then ``compression/sent_bytes_per_step`` counts the bytes across nodes and
            ``compression/intra_node_bytes_per_step`` the dense ones within the node.
        activation_checkpointing: As in :class:`~lightning_bigtrain.strategies.ZeroStrategy`: True (the repeated
            blocks) or the block classes recompute their activations in backward (Chen et al., 2016), applied at
            setup before DDP wraps the module; the names are in ``strategy.checkpointed_blocks``.
        **kwargs: Passed to Lightning's ``DDPStrategy`` (``start_method``, ``process_group_backend``,
            ``find_unused_parameters``, ...), except its comm-hook arguments, which this strategy owns.
    """

    strategy_name = "bigtrain_ddp_compressed"

    def __init__(
        self,
        compression: Compressor | AutoCompression | OneBitAdam | str = "powersgd",
        hierarchical: bool | None = None,
        activation_checkpointing: ActivationCheckpointing = False,
        **kwargs: Any,
    ) -> None:
        if hierarchical is not None and not isinstance(hierarchical, bool):
            raise TypeError(
                f"`CompressedDDPStrategy(hierarchical={hierarchical!r})`: pass True, False or None (hierarchical "
                "wherever it applies)."
            )
        if hierarchical and (compression == "onebit_adam" or isinstance(compression, OneBitAdam)):
            raise ValueError(
                "`CompressedDDPStrategy(compression=OneBitAdam(...), hierarchical=True)` is not supported: 1-bit "
                "Adam keeps per-rank optimizer state (local momentum, tracked scales) exchanged over all ranks at "
                "once. Leave `hierarchical` at None (flat for OneBitAdam), or compress gradients instead, e.g. "
                "compression='powersgd'."
            )
        given = [k for k in _OWN_HOOK_ARGS if kwargs.get(k) is not None]
        if given:
            raise ValueError(
                f"`CompressedDDPStrategy(..., {given[0]}=...)` is not supported: the strategy registers its "
                "own communication hook. Use `DDPStrategy` for a custom hook."
            )
        if compression == "onebit_adam":
            compression = OneBitAdam()
        self.momentum = compression if isinstance(compression, OneBitAdam) else None
        self._optimizer_ref: list[CompressedMomentumAdam | None] = [None]
        self._trainable: TrainableWatch | None = None  # fitting: requires_grad as when DDP was built
        compressor = resolve_compression(
            compression.compressor if isinstance(compression, OneBitAdam) else compression, "CompressedDDPStrategy"
        )
        if compressor is None:
            raise ValueError(
                '`CompressedDDPStrategy(compression=None)`: pass a compressor; for dense gradients use strategy="ddp".'
            )
        super().__init__(**kwargs)
        self.hierarchical = hierarchical
        self.activation_checkpointing = check_activation_checkpointing(activation_checkpointing,
                                                                       "CompressedDDPStrategy")  # fmt: skip
        self.checkpointed_blocks: list[str] = []  # names of the blocks activation checkpointing applies to
        self.compression = compressor
        self._support = CompressionSupport(compressor)
        self._exchange_group: Any = None  # the flat exchange's own process group (see _register_ddp_hooks)
        self._init_fault_tolerance()

    @override
    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, compression in _REGISTERED.items():
            strategy_registry.register(
                name,
                cls,
                description=f"lightning_bigtrain DDP with {compression} gradient compression",
                override=True,
                compression=compression,
            )
        strategy_registry.register(
            "bigtrain_ddp_auto",
            cls,
            description="lightning_bigtrain DDP with the gradient exchange chosen by timing the first steps",
            override=True,
            compression="auto",
        )
        strategy_registry.register(
            "bigtrain_ddp_onebit_adam",
            cls,
            description="lightning_bigtrain DDP with 1-bit Adam (frozen variance, compressed momentum)",
            override=True,
            compression="onebit_adam",
        )

    @property
    def compression_engine(self) -> GradientCompression | None:
        """The compression engine (state, byte counters), once the model is wrapped."""
        return self._support.engine

    @property
    def comm_bytes(self) -> int | None:
        """Bytes this rank has sent exchanging gradients since setup (ring-equivalent), as ZeroStrategy counts."""
        engine = self._support.engine
        return None if engine is None else int(engine.sent_bytes)

    @override
    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        shown = self.momentum if self.momentum is not None else self.compression  # what the user passed
        if not compression_applies(self.compression, self.model.module, self.world_size, "CompressedDDPStrategy",
                                   shown=shown):  # fmt: skip
            return  # dense DDP, with the reason warned
        refuse_sparse_gradients(self.model.module, "CompressedDDPStrategy", "Lightning's DDP (uncompressed)")
        nodes = self._node_groups()
        # The engine's collectives run on its own thread; DDP's run on the autograd thread (with
        # find_unused_parameters=True or a static graph's first step, DDP all-reduces its map of used parameters
        # while the last bucket is exchanged). On one process group two threads' collectives can reach the ranks in
        # different orders: gloo aborts ("collective mismatch"), NCCL hangs. The flat exchange gets a group of its
        # own (the hierarchical one runs on its node groups already).
        if nodes is None:
            self._exchange_group = torch.distributed.new_group()
        engine = GradientCompression(self.compression, self.model.module, group=self._exchange_group, nodes=nodes)
        if self.momentum is not None:
            self.model.register_comm_hook(self._optimizer_ref, phase_hook)
        else:
            self.model.register_comm_hook(engine, _compressed_hook)
        self._support.attach(engine, self.global_rank)

    def _node_groups(self) -> NodeGroups | None:
        """The hierarchical exchange's groups where it applies (``hierarchical``), else None (flat)."""
        if self.hierarchical is False or self.momentum is not None:
            return None
        if self.num_nodes < 2 or self.num_processes < 2:
            if self.hierarchical:
                warn_once(
                    f"`CompressedDDPStrategy(hierarchical=True)` has no effect with num_nodes={self.num_nodes} and "
                    f"devices={self.num_processes}: a hierarchical exchange needs several nodes of several devices "
                    "each. The exchange is flat.",
                    NoEffectWarning,
                )
            return None
        return NodeGroups.build(self.num_processes, self.num_nodes)

    @override
    def setup(self, trainer: L.Trainer) -> None:
        # Lightning's DDP applies the layer sync itself; torch's nn.SyncBatchNorm is refused in a CPU module.
        self._layer_sync = layer_sync_for(self._layer_sync, self.root_device.type)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            assert self.model is not None
            self.checkpointed_blocks = checkpoint_blocks_(self.model, self.activation_checkpointing,
                                                          "CompressedDDPStrategy")  # fmt: skip
        super().setup(trainer)
        self._trainable = TrainableWatch(self.lightning_module) if fitting else None
        engine = self._support.engine
        if self.momentum is None or engine is None or trainer.state.fn != TrainerFn.FITTING:
            return
        plugin = self.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed":
            raise ValueError(
                "`CompressedDDPStrategy(compression=OneBitAdam(...))` does not run under fp16 mixed precision: "
                "after the warm-up each rank steps on its own gradients, and an overflow on one rank only would "
                "skip the step there alone. Use precision='bf16-mixed' or '32-true'."
            )
        if len(self.optimizers) != 1:
            raise ValueError(
                f"`CompressedDDPStrategy(compression=OneBitAdam(...))` steps one Adam/AdamW; configure_optimizers "
                f"returned {len(self.optimizers)} optimizers."
            )
        (optimizer,) = self.optimizers
        warmup = self.momentum.resolve_warmup(trainer.estimated_stepping_batches)
        every = self.momentum.variance_refresh
        assert isinstance(self.model, DistributedDataParallel)
        refresh = (
            None
            if every is None
            else GradientCompression(Quantize(self.momentum.refresh_bits), self.model.module, seed=1)
        )
        wrapped = CompressedMomentumAdam.from_optimizer(
            optimizer,
            engine,
            warmup,
            refresh,
            every,
            self.momentum.track_scale,
            self.momentum.preconditioned,
            self.momentum.refresh_from,
        )
        for config in self.lr_scheduler_configs:
            if getattr(config.scheduler, "optimizer", None) is optimizer:
                config.scheduler.optimizer = wrapped
        self.optimizers = [wrapped]
        self._optimizer_ref[0] = wrapped

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._trainable is not None and self._trainable.describe():
            self._rebuild_ddp()
        super().on_train_batch_start(batch, batch_idx)

    def _rebuild_ddp(self) -> None:
        """Some parameters changed ``requires_grad`` since DDP was built (a fine-tuning callback unfroze a backbone):
        DDP's reducer all-reduces the parameters trainable when it was built, so an unfrozen one would be trained by
        each rank on its own data and the replicas would drift apart (as under Lightning's DDP, issue 20340), and a
        frozen one would leave the reducer waiting. Build DDP again over the trainable parameters now, with the same
        exchange: the compression engine keys its state by parameter name and is kept (error feedback, factors,
        step count)."""
        assert self._trainable is not None and isinstance(self.model, DistributedDataParallel)
        change = self._trainable.describe()
        if self.momentum is not None:
            raise RuntimeError(
                f"`CompressedDDPStrategy(compression=OneBitAdam(...))`: since setup, {change}. 1-bit Adam's compressed "
                "momentum is laid out over the parameters trainable at setup. Keep the parameters trainable and "
                "hold them still with a learning rate of 0 in a group of their own, or use a gradient compressor."
            )
        module = self.model.module
        self.model = None  # the old reducer's autograd hooks go with it
        gc.collect()
        self.model = self._setup_model(module)
        engine = self._support.engine
        if engine is not None:
            self.model.register_comm_hook(engine, _compressed_hook)
        self._trainable = TrainableWatch(self.lightning_module)
        rank_zero_info(f"CompressedDDPStrategy: {change}; DDP rebuilt over the trainable parameters.")

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        engine = self._support.engine
        auto = self.compression if isinstance(self.compression, AutoCompression) else None
        if auto is None or engine is None or not auto.deciding:  # timed only during the trials
            result = super().optimizer_step(optimizer, closure, model, **kwargs)
            self._support.after_step(self)
            if auto is not None and engine is not None:
                auto.step = engine.step  # its count of steps stays the run's (checkpointed with it)
            return result
        start = time.perf_counter()
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.root_device.type == "cuda":
            torch.cuda.synchronize(self.root_device)  # the step's kernels, not their launch
        seconds = time.perf_counter() - start
        self._support.after_step(self)
        if auto.record(seconds, engine, self.root_device):
            self._log_auto_choice(auto)
        return result

    def _log_auto_choice(self, auto: AutoCompression) -> None:
        """The decision, once: a sentence at info level, the choice and each candidate's median step to the loggers."""
        rank_zero_info(auto.summary())
        module = self.lightning_module
        if module is None or not self.is_global_zero:
            return
        assert auto.step_seconds is not None and auto.chosen is not None
        metrics = {"compression/auto_choice": float(auto.chosen)}
        metrics.update({f"compression/auto_step_s_{i}": s for i, s in enumerate(auto.step_seconds)})
        for logger in module.trainer.loggers:
            logger.log_metrics(metrics, step=module.trainer.global_step)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        state = self._support.state_for_checkpoint(self)
        if state is not None:
            checkpoint[CHECKPOINT_KEY] = state
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._support.load_from_checkpoint(checkpoint, self.global_rank)
        self._keep_progress_state(checkpoint)
        return checkpoint

    @override
    def teardown(self) -> None:
        self._support.close()
        if self._exchange_group is not None:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group(self._exchange_group)
            self._exchange_group = None
        super().teardown()
