"""DeepSpeedZeroStrategy: DeepSpeed's ZeRO engine behind ZeroStrategy's small API, on CPU (gloo) and GPU.

Lightning's ``DeepSpeedStrategy`` drives ``deepspeed.initialize`` well but refuses any accelerator other than
CUDA, although DeepSpeed itself runs ZeRO stages 1-3 on its CPU accelerator over gloo. This strategy builds
on it (the optimizer and scheduler from ``configure_optimizers``, gradient accumulation and clipping handed to
the engine, checkpoints in DeepSpeed's folder format) and adds: CPU support, the arguments of
:class:`~lightning_bigtrain.strategies.ZeroStrategy`, typed DeepSpeed options instead of JSON, a checked
``config`` override, step-seeded RNG for exact resume of models with dropout, and per-rank model-state
bytes in the run report.
"""

from __future__ import annotations

import copy
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.plugins.precision import DeepSpeedPrecision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from typing_extensions import override

from lightning_bigtrain._compat import (
    _IS_INTERACTIVE,
    average_fp32_masters,
    keep_average_fp32_across_swaps,
    restore_average_swap,
    weight_averaging_callbacks,
)
from lightning_bigtrain.checkpointing import atomic_folder_save, load_path
from lightning_bigtrain.functional.activation_checkpoint import (
    ActivationCheckpointing,
    check_activation_checkpointing,
    checkpoint_blocks_,
)
from lightning_bigtrain.functional.compression import Cast, Compressor
from lightning_bigtrain.functional.materialize import (
    Materialized,
    has_meta_tensors,
    init_records,
    init_seed,
    materialize_,
    record_init,
)
from lightning_bigtrain.functional.optim_probe import slice_step_error
from lightning_bigtrain.functional.sharding import auto_wrap_targets, cast_norm_inputs_
from lightning_bigtrain.strategies._common import (
    RNG_KEY,
    ZeroCommon,
    _listed,
    apply_layer_sync,
    refuse_sparse_gradients,
    warn_own_gradient_reads,
)
from lightning_bigtrain.strategies._compression import resolve_compression
from lightning_bigtrain.strategies._fault import FaultTolerantStrategyMixin
from lightning_bigtrain.strategies._layouts import saved_layout_kind
from lightning_bigtrain.strategies._trainable import TrainableWatch
from lightning_bigtrain.strategies.options import (
    DeepSpeedOptions,
    ZeroOptions,
    check_options,
    check_stage,
    deepspeed_available,
)
from lightning_bigtrain.warnings import NoEffectWarning, warn_once

if TYPE_CHECKING:
    import lightning as L

    from lightning_bigtrain._compat import _StrategyRegistry


__all__ = ["DeepSpeedZeroStrategy", "deepspeed_full_state_dict", "deepspeed_state_bytes"]


# Set from the Trainer: a value in the override would silently disagree with it.
_TRAINER_KEYS = {
    "train_batch_size": "the DataLoader's batch size",
    "train_micro_batch_size_per_gpu": "the DataLoader's batch size",
    "gradient_accumulation_steps": "Trainer(accumulate_grad_batches=...)",
    "gradient_clipping": "Trainer(gradient_clip_val=...)",
    "fp16": "Trainer(precision='16-mixed')",
    "bf16": "Trainer(precision='bf16-mixed')",
}


def _known_top_level_keys() -> set[str]:
    """Every top-level key DeepSpeed's config reader knows: the string constants of its config modules."""
    import importlib
    import re

    keys = {"zero_optimization", "tensorboard", "wandb", "csv_monitor", "comet", "compile", "amp",
            "sparse_attention", "elasticity", "autotuning", "compression_training", "nebula",
            "hybrid_engine", "curriculum_learning", "data_efficiency", "pipeline", "optimizer",
            "scheduler"}  # fmt: skip
    for name in ("deepspeed.runtime.constants", "deepspeed.profiling.constants", "deepspeed.autotuning.constants",
                 "deepspeed.runtime.data_pipeline.constants", "deepspeed.runtime.swap_tensor.constants",
                 "deepspeed.runtime.activation_checkpointing.config", "deepspeed.comm.constants",
                 "deepspeed.runtime.precision_config"):  # fmt: skip
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        keys.update(
            v for k, v in vars(module).items() if k.isupper() and isinstance(v, str) and re.fullmatch(r"[a-z_0-9]+", v)
        )
    return keys


def _check_override(config: Mapping[str, Any]) -> None:
    """Refuse keys DeepSpeed does not know, and keys the Trainer owns."""
    for key in config:
        if key in _TRAINER_KEYS:
            raise ValueError(
                f"`DeepSpeedOptions(config={{{key!r}: ...}})`: {key!r} is set from {_TRAINER_KEYS[key]}; "
                "set it there instead."
            )
    unknown = sorted(set(config) - _known_top_level_keys())
    if unknown:
        raise ValueError(
            f"`DeepSpeedOptions(config=...)`: DeepSpeed has no config key(s) {', '.join(map(repr, unknown))}. "
            "See https://www.deepspeed.ai/docs/config-json/ for the keys it reads."
        )
    zero = config.get("zero_optimization")
    if zero is not None:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from pydantic import ValidationError

        try:
            DeepSpeedZeroConfig(**dict(zero))
        except ValidationError as err:
            bad = [".".join(map(str, e["loc"])) for e in err.errors()]
            raise ValueError(
                f"`DeepSpeedOptions(config={{'zero_optimization': ...}})`: DeepSpeed refuses {', '.join(bad)}: "
                f"{err.errors()[0]['msg']}."
            ) from None
        if "stage" in zero:
            raise ValueError(
                "`DeepSpeedOptions(config={'zero_optimization': {'stage': ...}})`: the stage is "
                "`DeepSpeedZeroStrategy(stage=...)`'s first argument; set it there."
            )


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _tensors(obj: Any, depth: int = 3) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth == 0:
        return []
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item, depth - 1)]
    return []


def deepspeed_state_bytes(engine: Any) -> dict[str, int]:
    """This rank's bytes of model states under a DeepSpeed engine, by distinct storage.

    ``params``: the module's parameters (at stage 3 their local partitions, ``ds_tensor``) and the fp32
    partitions the optimizer steps; ``optimizer``: the optimizer's states; ``grads``: every other tensor the
    ZeRO optimizer holds (gradient partitions, reduction buckets, flat buffers).
    """
    optimizer = engine.optimizer
    params = [p for p in engine.module.parameters()]
    params += [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]
    params += [p for group in optimizer.param_groups for p in group["params"]]
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    seen: set[int] = set()

    def count(tensors: list[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            if t.numel() == 0 or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    out = {"params": count(params), "optimizer": count(states)}
    held = [t for value in vars(optimizer).values() for t in _tensors(value)]
    out["grads"] = count([p.grad for p in params if p.grad is not None] + held)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


_AVERAGE_KEY = "bigtrain_weight_average"  # WeightAveraging's average, kept in DeepSpeed's client state


class DeepSpeedZeroStrategy(FaultTolerantStrategyMixin, ZeroCommon, DeepSpeedStrategy):
    """ZeRO stages 1-3 on DeepSpeed's engine, with :class:`ZeroStrategy`'s arguments; CPU (gloo) and CUDA.

    Made as ``DeepSpeedZeroStrategy(stage, ...)`` or ``zero_strategy(stage, engine="deepspeed")``; registered as
    ``bigtrain_deepspeed_zero1/2/3`` and ``bigtrain_deepspeed_zero2_offload/3_offload``.

    What the engine does and where (DeepSpeed ZeRO, Rajbhandari et al., 2020; ZeRO++, Wang et al., 2023):
    stage 1 partitions the fp32 optimizer states, stage 2 the gradients too (reduced into partitions during
    backward), stage 3 the parameters (gathered per module for forward and backward). The user's optimizer
    and LR scheduler from ``configure_optimizers`` are wrapped by the engine; gradient accumulation and
    clipping by the global norm are the engine's, set from the Trainer's arguments; checkpoints are
    DeepSpeed's folder format (one shard per rank) and resume exactly;
    :func:`~lightning_bigtrain.strategies.zero.consolidate_checkpoint` turns one into a single file plain
    Lightning loads.

    Acts in: ``setup_environment`` (gloo or NCCL via ``deepspeed.init_distributed``), ``setup``
    (``deepspeed.initialize``), ``on_train_batch_start`` (step-seeded RNG), ``training_step`` (buffer broadcast),
    ``optimizer_step`` (model-state bytes once), ``save_checkpoint`` / ``load_checkpoint`` (DeepSpeed's, plus the
    run's seeds).

    Args:
        stage: ZeRO stage, 1, 2 or 3.
        offload_optimizer: Keep optimizer states in host memory and step there (ZeRO-Offload; DeepSpeed's
            CPU Adam is used when the optimizer is Adam/AdamW and its extension builds). No effect on CPU.
        offload_params: Stage 3: parameters in host memory too (ZeRO-Infinity's CPU tier). No effect on CPU.
        compression: ``Cast("fp16" | "bf16")`` (or ``"fp16"``/``"bf16"``): gradients communicated in that
            dtype (DeepSpeed's ``communication_data_type``). Other compressors need the torch engine.
        options: :class:`ZeroOptions` (checkpoint layout, buffer broadcast, step-seeded RNG, launch method,
            backend, timeout). DeepSpeed broadcasts buffers from rank 0 only at start-up; with
            ``broadcast_buffers=True`` (the default) they are broadcast before every training step, as the
            torch engine and DDP do, so BatchNorm statistics agree on every rank.
        deepspeed: :class:`DeepSpeedOptions`, DeepSpeed's own knobs and the raw ``config`` override.
        activation_checkpointing: As in :class:`~lightning_bigtrain.strategies.ZeroStrategy`: True (the repeated
            blocks) or the block classes, checkpointed with torch's composable ``checkpoint`` (the recomputation
            gathers stage 3's partitioned parameters again through DeepSpeed's hooks). DeepSpeed's own
            ``deepspeed.checkpointing`` (partitioned activations) is not used.
    """

    strategy_name = "bigtrain_deepspeed_zero"
    engine = "deepspeed"

    def __init__(
        self,
        stage: int = 3,
        *,
        offload_optimizer: bool = False,
        offload_params: bool = False,
        compression: Compressor | str | None = None,
        options: ZeroOptions | None = None,
        deepspeed: DeepSpeedOptions | None = None,
        activation_checkpointing: ActivationCheckpointing = False,
    ) -> None:
        if not deepspeed_available():
            raise ImportError(
                "`DeepSpeedZeroStrategy` needs DeepSpeed, a dependency of lightning_bigtrain that is not "
                "importable here: `pip install deepspeed`. ZeroStrategy (the torch engine) needs nothing extra."
            )
        check_stage(stage, offload_params=offload_params, owner="DeepSpeedZeroStrategy")
        options = check_options(options, "DeepSpeedZeroStrategy")
        checkpointing = check_activation_checkpointing(activation_checkpointing, "DeepSpeedZeroStrategy")
        ds = DeepSpeedOptions() if deepspeed is None else deepspeed
        if not isinstance(ds, DeepSpeedOptions):
            raise TypeError(
                f"`DeepSpeedZeroStrategy(deepspeed={ds!r})`: pass a `DeepSpeedOptions(...)` "
                "(lightning_bigtrain.strategies.DeepSpeedOptions)."
            )
        if ds.zeropp and stage != 3:
            raise ValueError(
                f"`DeepSpeedZeroStrategy(stage={stage}, deepspeed=DeepSpeedOptions("
                f"{', '.join(ds.zeropp)}...))`: ZeRO++ acts on stage 3's weight gathers and gradient "
                "reduce-scatters. Use stage=3."
            )
        if not options.save_distributed_checkpoint:
            raise ValueError(
                "`DeepSpeedZeroStrategy(options=ZeroOptions(save_distributed_checkpoint=False))`: "
                "DeepSpeed saves one shard per rank. Keep the default and write one file afterwards with "
                "`bigtrain consolidate`."
            )
        compressor = resolve_compression(compression, "ZeroStrategy")
        if compressor is not None and not isinstance(compressor, Cast):
            raise ValueError(
                f"`DeepSpeedZeroStrategy(compression={compressor!r})`: DeepSpeed's engine can only "
                "communicate gradients in a lower precision (Cast('fp16'/'bf16')). Use ZeroStrategy(stage=1) "
                "(the torch engine) for this compressor."
            )
        if ds.config is not None:
            _check_override(ds.config)
        zero: dict[str, Any] = {
            "stage": stage,
            "contiguous_gradients": ds.contiguous_gradients,
            "reduce_bucket_size": ds.reduce_bucket_size,
            "allgather_bucket_size": ds.allgather_bucket_size,
        }
        if ds.overlap_comm is not None:
            zero["overlap_comm"] = ds.overlap_comm
        if ds.prefetch_bucket_size is not None:
            zero["stage3_prefetch_bucket_size"] = ds.prefetch_bucket_size
        if ds.param_persistence_threshold is not None:
            zero["stage3_param_persistence_threshold"] = ds.param_persistence_threshold
        if ds.quantized_weights:
            zero["zero_quantized_weights"] = True
        if ds.quantized_gradients:
            zero["zero_quantized_gradients"] = True
        if ds.hierarchical_partition_size > 1:
            zero["zero_hpz_partition_size"] = ds.hierarchical_partition_size
        config: dict[str, Any] = {
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            # The user's optimizer is kept when offloading (DeepSpeed otherwise insists on its CPU Adam).
            "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 2**62,  # progress is Lightning's to log
        }
        if compressor is not None:
            config["communication_data_type"] = compressor.dtype
        if ds.config is not None:
            config = _merge(config, ds.config)
        self._offload_requested = (offload_optimizer or offload_params, offload_params)
        super().__init__(
            config=config,
            process_group_backend=options.process_group_backend,
            timeout=options.timeout,
            logging_level=30,  # WARNING
        )
        self.stage = stage
        self.activation_checkpointing = checkpointing
        self.checkpointed_blocks: list[str] = []  # names of the blocks activation checkpointing applies to
        self.offload_optimizer = offload_optimizer or offload_params
        self.offload_params = offload_params
        self.compression = compressor
        self.options = options
        self.deepspeed_options = ds
        self._rng_seed: int | None = None
        self._norm_hooks: list[Any] = []  # _match_norms_to_engine's, removed at teardown
        self._averaged: list[Any] = []  # WeightAveraging callbacks given a swap that keeps the average fp32
        self.memory: dict[str, int] = {}
        self._trainable: TrainableWatch | None = None  # fitting: requires_grad as at setup
        self._storages: list[tuple[str, Any, int]] = []  # stages 1-2 fitting: each parameter's storage at setup
        self._backwards_since_step = 0
        self._manual_clip: float | None = None  # manual optimization: `clip_gradients` for the next engine step
        self._init_fault_tolerance()

    @override
    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        cls._register_stages(strategy_registry, "bigtrain_deepspeed_zero", " on DeepSpeed's engine")

    # ---- launch and environment -------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        method = self.options.start_method
        if method == "auto":
            method = "fork" if _IS_INTERACTIVE else "popen"
        if method != "popen" and self.stage == 3:
            raise ValueError(
                f"`DeepSpeedZeroStrategy(stage=3, options=ZeroOptions(start_method={method!r}))`: "
                "launched this way, the main process receives rank 0's weights, which DeepSpeed's stage 3 "
                "holds partitioned. Run it as a script (start_method='popen') or use ZeroStrategy (the torch engine)."
            )
        self._start_method = method
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        # Lightning's DeepSpeedStrategy refuses anything but CUDA here; DeepSpeed itself runs on its CPU
        # accelerator over gloo.
        accelerator = type(self.accelerator).__name__ if self.accelerator is not None else "?"
        if accelerator not in ("CPUAccelerator", "CUDAAccelerator"):
            raise RuntimeError(f"`DeepSpeedZeroStrategy` runs on accelerator='cpu' or 'cuda', not {accelerator}.")
        DDPStrategy.setup_environment(self)
        self._keep_log_history()

    @override
    def setup_distributed(self) -> None:
        assert self.root_device is not None
        if self.root_device.type != "cpu":
            return super().setup_distributed()
        # CPU devices have no index to check against the local rank (Lightning's check assumes GPUs).
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()
        return None

    @override
    def setup(self, trainer: L.Trainer) -> None:
        assert self.root_device is not None
        on_cpu = self.root_device.type == "cpu"
        if on_cpu and self.deepspeed_options.zeropp:
            unsupported = [k for k in self.deepspeed_options.zeropp if k != "zero_hpz_partition_size"]
            if unsupported:
                raise ValueError(
                    f"`DeepSpeedOptions({', '.join(unsupported)})` cannot run with accelerator='cpu': ZeRO++ "
                    "quantizes with DeepSpeed's CUDA kernels, which its CPU accelerator does not have. Drop "
                    "them on CPU, or run on CUDA."
                )
        hpz = self.deepspeed_options.hierarchical_partition_size
        if hpz > 1 and self.world_size % hpz:
            raise ValueError(
                f"`DeepSpeedOptions(hierarchical_partition_size={hpz})` must divide the world size ({self.world_size})."
            )
        offload, offload_params = self._offload_requested
        assert isinstance(self.config, dict)
        if offload and on_cpu:
            warn_once(
                f"`DeepSpeedZeroStrategy(stage={self.stage}, offload_optimizer=True)` has no effect "
                "with accelerator='cpu': parameters, gradients and optimizer states are in host memory already.",
                NoEffectWarning,
            )
        elif offload:
            self.config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            if offload_params:
                self.config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
        if trainer.state.fn == TrainerFn.FITTING:
            refuse_sparse_gradients(self.model, f"DeepSpeedZeroStrategy(stage={self.stage})",
                                    "`ZeroStrategy(stage=1)` or Lightning's DDP")  # fmt: skip
            warn_own_gradient_reads(self.lightning_module, f"DeepSpeedZeroStrategy(stage={self.stage})",
                                    "None after backward (DeepSpeed keeps the reduced gradients in its own partitioned "
                                    "buffers)", absent=True)  # fmt: skip
            apply_layer_sync(self, f"DeepSpeedZeroStrategy(stage={self.stage})")
            assert self.model is not None
            self.checkpointed_blocks = checkpoint_blocks_(self.model, self.activation_checkpointing,
                                                          "DeepSpeedZeroStrategy")  # fmt: skip
        from lightning.pytorch.callbacks import LearningRateFinder, ModelPruning

        for callback in getattr(trainer, "callbacks", []):
            if isinstance(callback, ModelPruning) and getattr(callback, "_use_lottery_ticket_hypothesis", False):
                # Its reset replaces each parameter's `.data`, which DeepSpeed holds as views into its flat groups:
                # the module then computed with tensors DeepSpeed never updated (weights 0.14 off DDP's, silently).
                raise ValueError(
                    f"Lightning's `ModelPruning(use_lottery_ticket_hypothesis=...)` under `DeepSpeedZeroStrategy("
                    f"stage={self.stage})`: its reset of the remaining weights replaces each parameter's `.data`, and "
                    "DeepSpeed keeps the parameters as views into its own flat buffers, which would go on being "
                    "trained apart from the module. Pass `use_lottery_ticket_hypothesis=False`, or use `ZeroStrategy("
                    "stage=1 or 2)` (which takes the new values in)."
                )

        if any(isinstance(c, LearningRateFinder) for c in getattr(trainer, "callbacks", [])):
            # It failed inside Lightning's finder: "DeepSpeedZeroOptimizer is not an Optimizer".
            raise ValueError(
                f"Lightning's learning-rate finder (`Tuner.lr_find`, `LearningRateFinder`) under "
                f"`DeepSpeedZeroStrategy(stage={self.stage})`: it drives the optimizer with a torch LR scheduler, and "
                "DeepSpeed's optimizer is not a torch optimizer. Find the rate under `ZeroStrategy(stage="
                f"{self.stage})` or DDP (the same optimizer and data), then train here with it."
            )
        averaged = weight_averaging_callbacks(trainer)
        if averaged and self.stage == 3:
            # Its whole copy of the module met DeepSpeed's partitioned parameters (empty outside a gather) at the
            # first update: "The size of tensor a (512) must match the size of tensor b (0)".
            raise ValueError(
                f"`{type(averaged[0]).__name__}` under `DeepSpeedZeroStrategy(stage=3)`: it averages the module's "
                "parameters into a whole copy, and stage 3 holds each parameter partitioned. Use `ZeroStrategy("
                "stage=3)` (it keeps the average sharded like the module), or DeepSpeed's stage 1 or 2."
            )
        self._fix_host_allocator(on_cpu or offload)
        self._rng_seed = torch.initial_seed()  # replaced by the checkpoint's on resume
        if type(self.precision_plugin) is DeepSpeedPrecision:
            self.precision_plugin = _EngineClipping(self.precision_plugin.precision, self)
        self._backwards_since_step, self._manual_clip = 0, None
        assert self.model is not None
        if has_meta_tensors(self.model):
            self._materialize()
        super().setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        self._trainable = TrainableWatch(self.lightning_module) if fitting else None
        module = self.lightning_module
        self._averaged = averaged if self._sixteen_bit_dtype() is not None else []
        masters = _DeepSpeedMasters(module) if self._averaged and module is not None else None
        if masters is not None and masters.linked():
            # It averaged the 16-bit module, and its swap around validation copied both ways through it, rounding
            # the fp32 average to 16 bits at every validation: it averages DeepSpeed's fp32 masters now, each rank
            # the fragments its partition holds, gathered before the average is read whole.
            for callback in self._averaged:
                average_fp32_masters(callback, lambda: [masters])
        else:
            for callback in self._averaged:  # (no link to the masters: the swap at least keeps the fp32 values)
                keep_average_fp32_across_swaps(callback)
        # Stages 1-2 hold each parameter as a view into DeepSpeed's flat buffers (stage 3 swaps `.data` itself).
        self._storages = (
            [(name, p, p.data_ptr()) for name, p in module.named_parameters()]
            if fitting and self.stage < 3 and module is not None
            else []
        )

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        replaced = [name for name, p, pointer in self._storages if p.data_ptr() != pointer]
        if replaced:
            # DeepSpeed went on training its flat buffers while the module computed with the new tensors (weights
            # 0.39 off DDP's after one epoch, silently).
            raise RuntimeError(
                f"`DeepSpeedZeroStrategy(stage={self.stage})`: the `.data` of {_listed(replaced, most=4)} was replaced "
                "since setup (`p.data = ...`: a re-initialization, Lightning's lottery-ticket reset). DeepSpeed keeps "
                "the parameters as views into its own flat buffers and would go on training those apart from the "
                "module. Write new values in place (`p.data.copy_(...)`, under `torch.no_grad()`), or use "
                "`ZeroStrategy` (it takes the new values in)."
            )
        if self._trainable is not None and self._trainable.describe():
            raise RuntimeError(
                f"`DeepSpeedZeroStrategy(stage={self.stage})`: since setup, {self._trainable.describe()}. DeepSpeed "
                "laid the optimizer out in flat partitions of the parameters trainable at setup, so a parameter "
                "unfrozen later would never be trained and one frozen later would keep moving (momentum, weight "
                "decay). Use `ZeroStrategy(stage=3)` (sharded per parameter: it follows `requires_grad`), or keep "
                "the parameters trainable and hold them still with a learning rate of 0 in a group of their own."
            )
        super().on_train_batch_start(batch, batch_idx)

    @override
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """Around ``Trainer.init_module()`` and ``configure_model``. On the meta device, with the constructor's
        initializations recorded, materialized in :meth:`setup` (stage 3: one unit at a time, each partitioned before
        the next): under ``init_module(empty_init=True)``, and at stage 3 also ``init_module()`` and
        ``configure_model``. Lightning builds the module in uninitialized memory at stages 1-2 under
        ``empty_init=True``, whole at stage 3 under ``init_module()``, and in ``configure_model`` under
        ``deepspeed.zero.Init``, which partitions each layer as its constructor returns, so that an enclosing
        constructor's initialization (``self.apply(self._init_weights)``, a Hugging Face model's ``post_init``) meets
        empty partitions: silently skipped, or an IndexError (an embedding's padding row). Otherwise (a model built
        on a real device) as Lightning's, with initializations on meta tensors recorded (``torch.device("meta")``
        inside ``configure_model``)."""
        if empty_init is True or (self.stage == 3 and empty_init is None):
            with record_init(), torch.device("meta"), self.precision_plugin.tensor_init_context():
                yield
            return
        with record_init(), super().tensor_init_context(empty_init):
            yield

    # Not Lightning's `deepspeed.zero.Init` around `configure_model` (see `tensor_init_context`); and not overridden,
    # so that `Trainer.init_module` does not warn that it cannot build the model properly here.
    model_sharded_context = Strategy.model_sharded_context

    def _materialize(self) -> None:
        """Storage and initial values for a meta-device model (:func:`materialize_`: a Hugging Face model's
        ``_init_weights``, the constructor's recorded initializations, ``reset_parameters()``). Stage 3: each unit
        (the repeated blocks) is materialized and at once partitioned by ``deepspeed.zero.Init(module=...)``, so a
        rank holds one whole block at a time besides its partitions; the engine partitions the rest."""
        assert self.model is not None and self.root_device is not None
        records, seed = init_records(self.model), init_seed()
        copied: dict[Any, Any] = {}  # values several tensors copy, across the units
        parts = []
        if self.stage == 3:
            import deepspeed

            self._init_config_if_needed()  # (zero.Init reads the batch size from it)
            for unit in auto_wrap_targets(self.model):
                parts.append(materialize_(self.model, self.root_device, records, within=unit, seed=seed, copied=copied))
                deepspeed.zero.Init(module=unit, remote_device=self.remote_device, config_dict_or_path=self.config)
        parts.append(materialize_(self.model, self.root_device, records, seed=seed, copied=copied))
        self._report_unwritten(Materialized.join(parts), f"DeepSpeedZeroStrategy(stage={self.stage})")

    @override
    def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> tuple[Any, Any]:
        """``deepspeed.initialize`` over the trainable parameters; DeepSpeed's device is this rank's GPU, or on
        CPU its local rank (DeepSpeed's CPU accelerator ignores it, but reads the world from it)."""
        import argparse

        import deepspeed

        assert self.root_device is not None
        if optimizer is not None and not type(optimizer).__module__.startswith("deepspeed."):
            reason = slice_step_error(optimizer)
            if reason is not None:
                # DeepSpeed would run it on flat fp32 partitions: torch's Adafactor there trains unfactored (silently
                # another algorithm), Muon and LBFGS fail inside DeepSpeed's step.
                raise TypeError(
                    f"`DeepSpeedZeroStrategy(stage={self.stage})` cannot shard {type(optimizer).__name__}: DeepSpeed "
                    "hands the optimizer flat partitions of many parameters (at every stage), which is only correct "
                    f"for an element-wise optimizer, and {reason}. Use `ZeroStrategy(stage=3)` (each parameter "
                    "sharded whole-shaped, as a DTensor; it checks at setup that the optimizer can step those), "
                    "Lightning's DDP, or an element-wise optimizer (SGD, Adam, AdamW, ...)."
                )
        _release_stale_deepspeed_groups()
        sixteen = self._sixteen_bit_dtype()
        if sixteen is not None:
            self._norm_hooks = _match_norms_to_engine(model, sixteen)
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _device_rank(self) -> int:
        """DeepSpeed's ``device_rank``: this rank's GPU, or on CPU its local rank (DeepSpeed's CPU accelerator ignores
        it, but reads the world from it; Lightning passes the device index, None on CPU)."""
        assert self.root_device is not None
        return int(self.root_device.index if self.root_device.type == "cuda" else self.local_rank)

    @override
    def _initialize_deepspeed_inference(self, model: Any) -> None:
        """The engine for validate / test / predict outside ``fit``. Lightning's gives DeepSpeed the device's index as
        its rank, None on CPU (DeepSpeed then fails comparing it); here, as for training, the local rank there."""
        import argparse

        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        assert isinstance(self.config, dict) and self.root_device is not None
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}  # DeepSpeed's timers need one
        config.update({k: self.config[k] for k in ("fp16", "bf16") if k in self.config})
        if self.stage == 3:
            config["zero_allow_untested_optimizer"] = True
            config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        _release_stale_deepspeed_groups()
        sixteen = self._sixteen_bit_dtype()
        if sixteen is not None and not self._norm_hooks:
            self._norm_hooks = _match_norms_to_engine(model, sixteen)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )

    @override
    def teardown(self) -> None:
        super().teardown()
        for callback in self._averaged:
            restore_average_swap(callback)
        self._averaged = []
        _restore_torch_linear()
        for handle in self._norm_hooks:
            handle.remove()
        self._norm_hooks = []

    def _sixteen_bit_dtype(self) -> torch.dtype | None:
        """The dtype the engine casts the module's parameters to (its ``bf16`` / ``fp16`` config), or None."""
        assert isinstance(self.config, dict)
        for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            section = self.config.get(key)
            if isinstance(section, Mapping) and section.get("enabled"):
                return dtype
        return None

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning's loop has already divided the loss by `accumulate_grad_batches`; DeepSpeed's engine would
        # divide it again (`scale_wrt_gas=True` by default), shrinking gradients by the square of the
        # accumulation (Adam hides most of it; clipping and SGD do not). Divide once.
        kwargs.setdefault("scale_wrt_gas", False)
        module = self.lightning_module
        if module is not None and not module.automatic_optimization and self.stage < 3 and self._backwards_since_step:
            raise RuntimeError(
                f"`DeepSpeedZeroStrategy(stage={self.stage})` with manual optimization: `manual_backward` ran again "
                "before the optimizer stepped. DeepSpeed's stages 1 and 2 take every backward pass for the last of "
                "its step (their accumulation is the engine's, set from the Trainer), so the step's gradients would "
                "not be the sum over the passes. "
                "Accumulate with `Trainer(accumulate_grad_batches=N)` and automatic optimization, sum the losses "
                "into one `manual_backward`, or use stage=3 or ZeroStrategy (the torch engine), which accumulate."
            )
        self._backwards_since_step += 1
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.options.broadcast_buffers and self.world_size > 1:
            self._broadcast_buffers()
        return super().training_step(*args, **kwargs)

    @override
    def on_train_end(self) -> None:
        self._end_with_rank0_buffers()
        super().on_train_end()

    def full_state_dict(self) -> dict[str, Any]:
        """The module's weights whole, on the CPU (:func:`deepspeed_full_state_dict`). A collective: call it on every
        rank. Rank 0 gets them; the other ranks get ``{}``. See :func:`lightning_bigtrain.utilities.full_state_dict`."""
        assert self.lightning_module is not None
        return deepspeed_full_state_dict(self.lightning_module, self.global_rank)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """DeepSpeed's folder, written under a temporary name and committed by rank 0 (``filepath`` becomes a
        link)."""
        checkpoint[RNG_KEY] = self._rng_state()
        if "current_model_state" in checkpoint and "state_dict" in checkpoint:
            # WeightAveraging put its average in `state_dict` (which DeepSpeed's save drops: the engine writes the
            # module, holding its own weights) and those weights again in `current_model_state`: keep the average
            # instead (it was lost, and resuming failed on a KeyError in the callback).
            checkpoint[_AVERAGE_KEY] = checkpoint["state_dict"]
            del checkpoint["current_model_state"]
        save = super().save_checkpoint
        atomic_folder_save(self, filepath, lambda staging: save(checkpoint, staging, storage_options))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        location = str(self.broadcast(load_path(str(checkpoint_path)) if self.is_global_zero else None))
        kind = str(self.broadcast(saved_layout_kind(location) if self.is_global_zero else None))
        if kind != "deepspeed":
            raise ValueError(
                f"`DeepSpeedZeroStrategy(stage={self.stage})` cannot resume {location!r}: it is not DeepSpeed's "
                f"checkpoint ({'one file: plain Lightning' if kind == 'file' else 'a folder: ZeroStrategy'}'s). "
                "Resume it with ZeroStrategy (the torch engine resumes plain Lightning files and "
                "either of its layouts at any stage), or load its weights into the module before `fit`."
            )
        module = self.lightning_module
        if self.stage == 3 and module is not None and module.trainer.state.fn != TrainerFn.FITTING:
            checkpoint = self._load_weights_to_evaluate(location)
        else:
            checkpoint = super().load_checkpoint(location, weights_only)
        self._restore_rng_state(checkpoint)
        self._keep_progress_state(checkpoint)
        average = checkpoint.pop(_AVERAGE_KEY, None)
        if average is not None and module is not None:
            # As WeightAveraging.on_load_checkpoint reads them: the average, and the module's own weights (loaded).
            checkpoint["state_dict"] = average
            checkpoint["current_model_state"] = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return checkpoint

    def _load_weights_to_evaluate(self, location: str) -> dict[str, Any]:
        """Stage 3 outside ``fit`` (``validate`` / ``test`` / ``predict`` with ``ckpt_path``, "best" included): the
        engine built for evaluation has no ZeRO optimizer, and DeepSpeed reads stage 3's weights only through one
        (it failed: "'DeepSpeedZeRoOffload' object has no attribute '_restore_from_bit16_weights'"). The fp32 weights
        are rebuilt from the partitions (DeepSpeed's ``zero_to_fp32``, every rank) and rank 0 writes them into the
        gathered parameters, which DeepSpeed partitions again."""
        import contextlib
        import io
        import os
        import tempfile

        import deepspeed
        from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

        module = self.lightning_module
        assert module is not None
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            checkpoint = convert_zero_checkpoint_to_fp32_state_dict(location, os.path.join(tmp, "weights.ckpt"))
        weights = checkpoint.pop("state_dict")
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0):
            if self.is_global_zero:
                module.load_state_dict(weights, strict=module.strict_loading)
        return checkpoint

    # ---- model-state bytes ------------------------------------------------------------------------
    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        closure = self._closure_counting_state(closure, self._count_memory)
        clip, self._manual_clip = self._manual_clip, None
        engine_optimizer = getattr(self.deepspeed_engine, "optimizer", None)
        configured = getattr(engine_optimizer, "clip_grad", None)
        if clip is not None and configured is not None:
            engine_optimizer.clip_grad = clip  # type: ignore[union-attr]
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            if clip is not None and configured is not None:
                engine_optimizer.clip_grad = configured  # type: ignore[union-attr]
            self._backwards_since_step = 0

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's model-state bytes now (:func:`deepspeed_state_bytes`)."""
        return deepspeed_state_bytes(self.deepspeed_engine)

    def _count_memory(self) -> None:
        """Per-rank bytes of parameters (stage 3: this rank's partitions), the fp32 partitions and gradients the
        engine keeps, and optimizer states, counted once in the second step after backward."""
        self._log_state_bytes(self.model_state_bytes())


class _DeepSpeedMasters:
    """DeepSpeed's stages 1-2 with a 16-bit module: the fp32 master fragment of each 16-bit parameter this rank holds
    (DeepSpeed's ``_hp_mapping``: where in the parameter it starts and its fp32 values in the engine's flat partition),
    read as :func:`~lightning_bigtrain._compat.average_fp32_masters` reads ``FlatShardedOptimizer``: ``master_parts``
    and ``gather_parts_``."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.dtype in (torch.bfloat16, torch.float16)]

    def linked(self) -> bool:
        """Whether every 16-bit parameter has DeepSpeed's link to its master (its stages 1-2 set it)."""
        return bool(self.params) and all(hasattr(p, "_hp_mapping") and hasattr(p, "_dp_group") for p in self.params)

    def master_parts(self) -> list[tuple[nn.Parameter, int, int, torch.Tensor]]:
        out = []
        for p in self.params:
            mapping = p._hp_mapping  # type: ignore[attr-defined]
            if mapping is None:  # none of it in this rank's partition
                out.append((p, 0, 0, p.new_empty(0, dtype=torch.float32)))
                continue
            at = mapping.lp_fragment_address
            out.append((p, at.start, at.start + at.numel, mapping.get_hp_fragment().reshape(-1)))
        return out

    @torch.no_grad()
    def gather_parts_(self, targets: dict[int, torch.Tensor]) -> None:
        """Each target's elements from the rank whose partition holds them (an all-reduce of one flat buffer in which
        every rank writes its fragments and zeros elsewhere: a collective, call it on every rank)."""
        chosen = [p for p in self.params if id(p) in targets]
        if not chosen:
            return
        flat = torch.zeros(sum(p.numel() for p in chosen), dtype=torch.float32, device=chosen[0].device)
        offset, spans = 0, []
        for p in chosen:
            mapping = p._hp_mapping  # type: ignore[attr-defined]
            if mapping is not None:
                a, n = mapping.lp_fragment_address.start, mapping.lp_fragment_address.numel
                flat[offset + a : offset + a + n].copy_(targets[id(p)].reshape(-1)[a : a + n])
            spans.append((p, offset))
            offset += p.numel()
        torch.distributed.all_reduce(flat, group=chosen[0]._dp_group)  # type: ignore[attr-defined]
        for p, start in spans:
            target = targets[id(p)]
            target.copy_(flat[start : start + p.numel()].view(target.shape))


class _EngineClipping(DeepSpeedPrecision):
    """DeepSpeed's precision plugin whose ``clip_gradients`` acts under manual optimization. Lightning's is a no-op
    (the engine clips by the norm in ``Trainer(gradient_clip_val=...)``, which manual optimization does not allow), so
    ``self.clip_gradients(opt, gradient_clip_val=...)`` in a manual ``training_step`` did nothing. Here it sets the
    engine's clipping norm for the next step only (the engine clips the reduced partitions by the global norm, as
    ``torch.nn.utils.clip_grad_norm_`` does). Automatic optimization is unchanged."""

    def __init__(self, precision: Any, strategy: DeepSpeedZeroStrategy) -> None:
        super().__init__(precision)
        self._strategy = strategy

    @override
    def clip_gradients(
        self,
        optimizer: Any,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        module = self._strategy.lightning_module
        if module is None or module.automatic_optimization or clip_val <= 0:
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
            raise ValueError(
                f"`clip_gradients(gradient_clip_algorithm={str(gradient_clip_algorithm.value)!r})` under "
                "DeepSpeedZeroStrategy: DeepSpeed's engine clips by the global norm only. Pass "
                "gradient_clip_algorithm='norm', or use ZeroStrategy (the torch engine), which clips by value too."
            )
        self._strategy._manual_clip = float(clip_val)
        return None

    @override
    def forward_context(self) -> Any:
        """Under ``"bf16-mixed"`` / ``"16-mixed"`` the engine holds 16-bit parameters; autocast runs each op in the
        dtype it needs, so a tensor the forward makes in fp32 (a position table, a mask) meets them without a dtype
        error (Lightning's plugin runs none: "expected m1 and m2 to have the same dtype" on Lightning's demo
        Transformer). Normalization layers, which autocast leaves alone on CPU, see :func:`_match_norms_to_engine`."""
        if self.precision not in ("bf16-mixed", "16-mixed"):
            return super().forward_context()
        device = self._strategy.root_device
        return torch.autocast(device.type if device is not None else "cpu", dtype=self._desired_dtype)


def _match_norms_to_engine(model: torch.nn.Module, dtype: torch.dtype) -> list[Any]:
    """Make torch's normalization layers run in the engine's 16-bit ``dtype``. DeepSpeed casts the parameters only
    (never buffers, and no layer is kept in fp32 at this version), so a batch norm's 16-bit weight met its fp32
    running statistics ("expected scalar type BFloat16 but found Float" on torchvision's ResNet and MobileNet), and a
    layer norm's met an fp32 activation the forward made (a position table: "mixed dtype (CPU): expect parameter to
    have scalar type of Float" on Lightning's demo Transformer). The batch norms' statistics are cast to ``dtype``
    (the engine's dtype for everything else) and each norm's floating inputs to its weight's dtype
    (:func:`~lightning_bigtrain.functional.sharding.cast_norm_inputs_`); the hook handles are returned, to be removed
    at teardown."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.weight is not None:
            for name in ("running_mean", "running_var"):
                stat = getattr(module, name, None)
                if isinstance(stat, torch.Tensor) and stat.is_floating_point():
                    stat.data = stat.data.to(dtype)
    return cast_norm_inputs_(model)


def _restore_torch_linear() -> bool:
    """Put torch's ``torch.nn.functional.linear`` back where DeepSpeed's stage-3 initialisation replaced it with its
    memory-efficient autograd function "for the life of the process": later models in the process (a notebook's
    next fit, a sweep's next trial, a teacher) would otherwise run DeepSpeed's function, whose CUDA kernels round
    differently from torch's. Another library's replacement is left alone. True if something was restored."""
    try:
        from deepspeed.runtime.zero.linear import zero3_linear_wrap
        from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher
    except ImportError:  # a DeepSpeed without the replacement
        return False
    original = getattr(patcher, "linear_bk", None)
    if original is None or torch.nn.functional.linear is not zero3_linear_wrap:
        return False
    torch.nn.functional.linear = original
    return True


def _release_stale_deepspeed_groups(force: bool = False) -> bool:
    """Drop DeepSpeed's cached process groups when they no longer belong to the live process group (or always,
    with ``force``); return whether they were dropped.

    DeepSpeed keeps its groups (a clone of the world, data/model-parallel groups, a device mesh, an ``mpu``) in
    module globals for the life of the process. A process group destroyed by torch rather than through
    ``deepspeed.comm`` (a notebook or a sweep that re-initialises its group between fits) leaves them pointing at a
    dead group, and the next engine fails in its first broadcast ("Group ... is not registered"). Recent
    DeepSpeed releases have a function for this; older ones do not, and their globals are reset here by name."""
    from deepspeed.utils import groups
    from torch.distributed.distributed_c10d import _world

    live = _world.pg_group_ranks
    singles = [getattr(groups, name, None) for name in _DEEPSPEED_GROUP_GLOBALS]
    maps = [getattr(groups, name, None) for name in _DEEPSPEED_GROUP_MAPS if not name.endswith("_RANKS")]
    cached = [g for g in singles if g is not None]
    cached += [g for m in maps if isinstance(m, dict) for g in m.values() if g is not None]
    mesh = getattr(groups, "mesh_device", None)
    if mesh is not None:
        cached += list(mesh.get_all_groups())
    stale = getattr(groups, "mpu", None) is not None or any(g not in live for g in cached)
    if not (force or stale):
        return False
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(None)
        return True
    for name in (*_DEEPSPEED_GROUP_GLOBALS, "mesh_device", "mpu"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in _DEEPSPEED_GROUP_MAPS:
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()
    return True


_DEEPSPEED_GROUP_GLOBALS = (
    "_WORLD_GROUP",
    "_DATA_PARALLEL_GROUP",
    "_MODEL_PARALLEL_GROUP",
    "_TENSOR_MODEL_PARALLEL_GROUP",
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP",
)
_DEEPSPEED_GROUP_MAPS = (
    "_EXPERT_PARALLEL_GROUP",
    "_EXPERT_PARALLEL_GROUP_RANKS",
    "_EXPERT_DATA_PARALLEL_GROUP",
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS",
    "_ALL_TO_ALL_GROUP",
)


def deepspeed_full_state_dict(module: torch.nn.Module, rank: int) -> dict[str, Any]:
    """A module under DeepSpeed's engine (this package's or Lightning's ``DeepSpeedStrategy``), whole, on the CPU: the
    fp32 masters DeepSpeed's optimizer keeps of the parameters it trains (gathered from the ranks' partitions; the
    module itself holds 16-bit copies under ``"bf16-mixed"`` / ``"16-mixed"``, and at stage 3 empty partitions
    outside a gather), the others (frozen ones, buffers) as the module holds them (gathered at stage 3). A collective
    over every rank; ``rank`` 0 gets the weights, the others ``{}``."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    out: dict[str, Any] = {}
    for name, value in module.state_dict(keep_vars=True).items():  # the same order on every rank
        if isinstance(value, torch.nn.Parameter):
            whole = safe_get_full_fp32_param(value) if value.requires_grad else None  # a collective
            if whole is None:  # not trained by the optimizer: the module's own (gathered at stage 3)
                with deepspeed.zero.GatheredParameters([value], enabled=hasattr(value, "ds_id")):
                    whole = value.detach().clone()
            value = whole
        if rank == 0 and isinstance(value, torch.Tensor):
            out[name] = value.detach().to("cpu", copy=True)
    return out
