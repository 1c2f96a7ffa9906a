"""The settings table: every feature as a tiny configuration that the generic tests drive.

Each row says how to build the model, the data and the Trainer arguments that switch the feature on,
and which bad inputs must be rejected with which message. Generic tests
(`tests/test_settings_integration.py`) check for every row that it fits on 2 CPU ranks with identical
replicas (each rank's own replicated tensors; rows with sharded parameters against the same run at stage 1,
whose parameters are replicas), that a run stopped and resumed from a checkpoint ends where the uninterrupted
run ends, and that each bad input raises its error. A new feature adds its row here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_bigtrain.callbacks import (
    DistillationOptions,
    KnowledgeDistillation,
    MagnitudePruning,
    OperatorFusion,
    PruningSchedule,
    RunReport,
    StructuredPruning,
)
from lightning_bigtrain.compression import AutoCompression, Cast, OneBit, PowerSGD, Quantize, TopK
from lightning_bigtrain.data import FashionMNISTDataModule, ShakespeareDataModule
from lightning_bigtrain.models import CharGPT, FashionCNN
from lightning_bigtrain.plugins import BF16Precision
from lightning_bigtrain.strategies import (
    CompressedDDPStrategy,
    DeepSpeedOptions,
    DeepSpeedZeroStrategy,
    ZeroOptions,
    ZeroStrategy,
    zero_strategy,
)

__all__ = ["SETTINGS", "BadInput", "Setting", "by_name"]


@dataclass(frozen=True)
class BadInput:
    """A call that must raise ``error`` with a message matching the regex ``match``."""

    id: str
    call: Callable[[], Any]
    error: type[Exception]
    match: str


@dataclass(frozen=True)
class Setting:
    """One feature in a tiny configuration.

    Attributes:
        name: Row id (used as the pytest id).
        model: Builds the LightningModule.
        data: Builds the LightningDataModule (small real-data subset).
        trainer_kwargs: Builds the feature's Trainer arguments (strategy, plugins, callbacks); a factory
            because callbacks and strategies hold state.
        bad_inputs: Calls that must be rejected.
        resume_atol: Allowed difference between resumed and uninterrupted weights, with its reason.
        ddp_atol: For rows whose parameters are sharded (no rank holds a replica to compare with the other's):
            allowed difference between the gathered weights and those of the same run on the same engine at
            stage 1 (same seed, callbacks and plugins; parameters replicated), which reduces in another layout.
        mask_slack: Fraction of weights allowed to be zero in only one of those two runs (pruning of sharded
            weights finds its threshold by bisection over all-reduced counts, the replicated run exactly, so
            near-ties may fall on either side); the other weights are held to ``ddp_atol``.
        replicated_twin: The replicated strategy to compare a sharded row with, where the same engine at stage 1
            cannot run the row (movement pruning needs whole averaged gradients: DDP).
        num_nodes: "Nodes" of 2 ranks each the row runs on (``Trainer(num_nodes=..., devices=2)``, every node on
            this host): rows whose feature acts across nodes.
    """

    name: str
    model: Callable[[], L.LightningModule]
    data: Callable[[], L.LightningDataModule]
    trainer_kwargs: Callable[[], dict[str, Any]]
    bad_inputs: tuple[BadInput, ...] = field(default=())
    resume_atol: float = 0.0
    ddp_atol: float = 2e-5
    mask_slack: float = 0.0
    replicated_twin: Callable[[], Any] | None = None
    num_nodes: int = 1


def _tiny_cnn() -> FashionCNN:
    return FashionCNN(channels=(8, 16))


def _nm_named_cnn() -> Any:
    return MagnitudePruning(pattern="2:4", parameters=["features.*.weight"])._choose(_tiny_cnn())


def _tiny_fashion() -> FashionMNISTDataModule:
    return FashionMNISTDataModule(batch_size=16, subset=96)


def _tiny_gpt() -> CharGPT:
    return CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=32, warmup_steps=2)


def _tiny_gpt_dropout() -> CharGPT:
    return CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=32, warmup_steps=2, dropout=0.1)


def _tiny_shakespeare() -> ShakespeareDataModule:
    return ShakespeareDataModule(block_size=32, batch_size=8, subset=48)


def _tiny_shakespeare_4_ranks() -> ShakespeareDataModule:
    """The same 3 batches per rank and epoch over 4 ranks."""
    return ShakespeareDataModule(block_size=32, batch_size=8, subset=96)


def _teacher(build: Callable[[], L.LightningModule]) -> L.LightningModule:
    """A teacher with the same weights on every rank (its own seed, the global RNG left as it was)."""
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        return build()


def _kd_cnn() -> dict[str, Any]:
    teacher = _teacher(lambda: FashionCNN(channels=(16, 32)))
    kd = KnowledgeDistillation(teacher, temperature=3.0, alpha=0.7, features={"features.5": "features.5"},
                               options=DistillationOptions(alpha_end=0.3))  # fmt: skip
    return {"strategy": "ddp", "callbacks": [kd]}


def _kd_zero3_gpt() -> dict[str, Any]:
    teacher = _teacher(lambda: CharGPT(block_size=32, n_layer=2, n_head=2, n_embd=48))
    return {"strategy": ZeroStrategy(stage=3, min_wrap_params=1000), "callbacks": [KnowledgeDistillation(teacher)]}


def _prune_ddp_cnn() -> dict[str, Any]:
    # The ramp spans the interruption (step 3): masks, schedule position and the rewind copy are restored.
    pruning = MagnitudePruning(0.75, schedule=PruningSchedule(start=1, end=4, frequency=1), rewind=1, plot=False)
    return {"strategy": "ddp", "callbacks": [pruning]}


def _prune_zero3_gpt() -> dict[str, Any]:
    # Sharded weights: thresholds from all-reduced counts; movement scores are checkpointed and resharded.
    pruning = MagnitudePruning(0.6, criterion="movement", schedule=PruningSchedule(start=2, end=5, frequency=1),
                               plot=False)  # fmt: skip
    return {"strategy": ZeroStrategy(stage=3, min_wrap_params=1000), "callbacks": [pruning]}


def _ema() -> L.Callback:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    return EMAWeightAveraging(decay=0.7)


def _structured_ddp_cnn() -> dict[str, Any]:
    # Channels removed at steps 1, 3 (before the interruption) and 4: the resumed run rebuilds the pruned shapes.
    return {
        "strategy": "ddp",
        "callbacks": [StructuredPruning(0.5, schedule=PruningSchedule(start=1, end=4, frequency=2))],
    }


def _fusion_ddp_gpt() -> dict[str, Any]:
    # Regional compile, the fused optimizer and the attention swap, across the interruption.
    fusion = OperatorFusion(compile="regional", fused_optimizer=True, swap_modules=True)
    return {"strategy": "ddp", "callbacks": [fusion]}


_KD_CACHE = tempfile.gettempdir()


def _kd_cache_cnn() -> dict[str, Any]:
    # Every rank of one test (one parent process) and the stopped run and its resumption share the cache file,
    # as a relaunched job does; the cached top-k logits give the loss the live teacher gives.
    teacher = _teacher(lambda: FashionCNN(channels=(16, 32)))
    cache = os.path.join(_KD_CACHE, f"bigtrain-settings-kd-cache-{os.getppid()}.pt")
    return {"strategy": "ddp", "callbacks": [KnowledgeDistillation(teacher, temperature=2.0, cache=cache)]}


def _nm_ddp_gpt() -> dict[str, Any]:
    # 2:4 from step 2 on, across the interruption: masks and the schedule position are restored.
    pruning = MagnitudePruning(pattern="2:4", schedule=PruningSchedule(start=2, end=2, frequency=1), plot=False)
    return {"strategy": "ddp", "callbacks": [pruning]}


def _ddp_with_report() -> dict[str, Any]:
    return {"strategy": "ddp", "callbacks": [RunReport(verbose=False, warmup_steps=0)]}


def _zero(stage: int) -> Callable[[], dict[str, Any]]:
    # A small unit threshold so the tiny models are sharded block by block, as large ones are.
    return lambda: {"strategy": ZeroStrategy(stage=stage, min_wrap_params=1000)}


class _OneReplicaDDP(DDPStrategy):
    """DDP whose ranks all read the data as one replica (the sampler Lightning injects takes ``num_replicas=1``):
    every rank steps on the same batches and the averaged gradient is one process's. The twin of the rows whose
    ranks split the model rather than the data (tensor and pipeline parallelism on 2 ranks: one data replica)."""

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}


def _hf_llama() -> L.LightningModule:
    """Hugging Face's Llama (rotary angles, grouped-query attention, SwiGLU MLP, RMSNorm) in a module a user would
    write, built from a config as the conformance matrix builds it."""
    from benchmarks.conformance import FAMILIES, _build

    return _build(FAMILIES["hf_llama"], 0)


def _model_parallel(**kwargs: Any) -> Callable[[], dict[str, Any]]:
    return lambda: {"strategy": ZeroStrategy(**kwargs)}


def _deepspeed(stage: int) -> Callable[[], dict[str, Any]]:
    # Tiny buckets and no persistence threshold, so the tiny models are partitioned and bucketed as large ones.
    options = DeepSpeedOptions(reduce_bucket_size=5000, allgather_bucket_size=5000,
                               param_persistence_threshold=0 if stage == 3 else None)  # fmt: skip
    return lambda: {"strategy": DeepSpeedZeroStrategy(stage=stage, deepspeed=options)}


SETTINGS: tuple[Setting, ...] = (
    # Plain Lightning DDP on the reference models: the baseline every feature is compared with.
    # Resume is exact: gloo's 2-rank all-reduce is deterministic and the models use no dropout.
    Setting(
        name="ddp_cnn",
        model=_tiny_cnn,
        data=_tiny_fashion,
        trainer_kwargs=_ddp_with_report,
        bad_inputs=(
            BadInput("cnn_channels", lambda: FashionCNN(channels=()), ValueError, r"FashionCNN\(channels=\(\)\)"),
            BadInput("fashion_batch", lambda: FashionMNISTDataModule(batch_size=0), ValueError, r"batch_size must"),
            BadInput("report_warmup", lambda: RunReport(warmup_steps=-1), ValueError, r"RunReport\(warmup_steps=-1\)"),
            BadInput("report_path", lambda: RunReport(path="r.txt"), ValueError, r"ending in `\.md`"),
        ),
    ),
    Setting(
        name="ddp_gpt",
        model=_tiny_gpt,
        data=_tiny_shakespeare,
        trainer_kwargs=_ddp_with_report,
        bad_inputs=(
            BadInput("gpt_heads", lambda: CharGPT(n_embd=30, n_head=4), ValueError, r"n_head must divide n_embd"),
            BadInput("gpt_dropout", lambda: CharGPT(dropout=1.0), ValueError, r"CharGPT\(dropout=1\.0\)"),
            BadInput("shakespeare_split", lambda: ShakespeareDataModule(val_fraction=0.6, test_fraction=0.5),
                     ValueError, r"sum to less than 1"),
        ),
    ),
    # ZeRO. Resume is exact, dropout included: sharded checkpoints restore weights, optimizer shards and
    # schedule, and the step-seeded generators draw the same dropout masks as the uninterrupted run.
    Setting(
        name="zero3_gpt",
        model=_tiny_gpt_dropout,
        data=_tiny_shakespeare,
        trainer_kwargs=_zero(3),
        bad_inputs=(
            BadInput("stage4", lambda: ZeroStrategy(stage=4), ValueError,
                     r"`ZeroStrategy\(stage=4\)` is not supported: stage must be 1, 2 or 3"),
            BadInput("stage0", lambda: ZeroStrategy(stage=0), ValueError, r"stage must be 1, 2 or 3"),
            BadInput("offload_params_stage2", lambda: ZeroStrategy(stage=2, offload_params=True), ValueError,
                     r"only offloadable, at stage 3"),
            BadInput("start_method", lambda: ZeroOptions(start_method="thread"), ValueError,  # type: ignore[arg-type]
                     r"ZeroOptions\(start_method='thread'\)"),
            BadInput("options_type", lambda: ZeroStrategy(options={"broadcast_buffers": False}), TypeError,  # type: ignore[arg-type]
                     r"pass a `ZeroOptions\(...\)`"),
        ),
    ),
    Setting(name="zero2_cnn", model=_tiny_cnn, data=_tiny_fashion, trainer_kwargs=_zero(2)),
    # Sharded checkpoints written in the background and committed once every rank has written them.
    Setting(name="zero3_async_gpt", model=_tiny_gpt_dropout, data=_tiny_shakespeare,
            trainer_kwargs=lambda: {"strategy": ZeroStrategy(stage=3, min_wrap_params=1000,
                                                             options=ZeroOptions(async_checkpoint=True))}),
    # Pure bf16 with compensated steps. Resume is exact: the Kahan buffers are optimizer state, and the
    # stochastic rounding draws depend only on (seed, step), both checkpointed.
    Setting(
        name="bf16_kahan_ddp_gpt",
        model=_tiny_gpt,
        data=_tiny_shakespeare,
        trainer_kwargs=lambda: {"strategy": "ddp", "plugins": [BF16Precision("kahan")]},
        bad_inputs=(
            BadInput("compensation", lambda: BF16Precision("round"), ValueError,  # type: ignore[arg-type]
                     r"BF16Precision\(compensation='round'\)` is not supported"),
            BadInput("chunk_numel", lambda: BF16Precision(chunk_numel=0), ValueError,
                     r"BF16Precision\(chunk_numel=0\)`: must be >= 1"),
            BadInput("fp16_model", lambda: BF16Precision().convert_module(_tiny_cnn().half()), ValueError,
                     r"torch\.float16 parameters \(FashionCNN\)"),
            BadInput("second_precision", lambda: L.Trainer(precision="bf16-mixed", plugins=[BF16Precision()]),
                     ValueError, r"Received both `precision=bf16-mixed` and `plugins="),
        ),
    ),
    Setting(
        name="bf16_stochastic_zero2_cnn",
        model=_tiny_cnn,
        data=_tiny_fashion,
        trainer_kwargs=lambda: {**_zero(2)(), "plugins": [BF16Precision("stochastic")]},
    ),
    Setting(
        name="bf16_kahan_zero3_gpt",
        model=_tiny_gpt_dropout,
        data=_tiny_shakespeare,
        trainer_kwargs=lambda: {**_zero(3)(), "plugins": [BF16Precision("kahan")]},
    ),
    Setting(name="zero1_gpt", model=_tiny_gpt_dropout, data=_tiny_shakespeare, trainer_kwargs=_zero(1)),
    # DeepSpeed's engine behind the same API, on CPU. Resume is exact, dropout included (DeepSpeed's
    # checkpoint folder plus the step-seeded generators).
    Setting(
        name="ds_zero2_gpt",
        model=_tiny_gpt_dropout,
        data=_tiny_shakespeare,
        trainer_kwargs=_deepspeed(2),
        bad_inputs=(
            BadInput("engine", lambda: zero_strategy(engine="megatron"), ValueError,  # type: ignore[arg-type]
                     r"zero_strategy\(engine='megatron'\)`: choose one of torch, deepspeed, auto"),
            BadInput("deepspeed_engine_on_torch_class", lambda: ZeroStrategy(engine="deepspeed"),  # type: ignore[arg-type]
                     ValueError, r"ZeroStrategy is the torch engine. For DeepSpeed's engine use `DeepSpeedZero"),
            BadInput("options_without_engine", lambda: ZeroStrategy(deepspeed=DeepSpeedOptions()), ValueError,
                     r"ZeroStrategy\(deepspeed=DeepSpeedOptions\(...\)\)`: ZeroStrategy is the torch engine"),
            BadInput("zeropp_stage2", lambda: DeepSpeedZeroStrategy(2,
                     deepspeed=DeepSpeedOptions(quantized_weights=True)), ValueError, r"ZeRO\+\+ acts on stage 3"),
            BadInput("unknown_key", lambda: DeepSpeedZeroStrategy(deepspeed=DeepSpeedOptions(
                     config={"wall_clock_breakdwn": True})), ValueError,
                     r"DeepSpeed has no config key\(s\) 'wall_clock_breakdwn'"),
            BadInput("unknown_zero_key", lambda: DeepSpeedZeroStrategy(deepspeed=DeepSpeedOptions(
                     config={"zero_optimization": {"overlap_com": True}})), ValueError,
                     r"DeepSpeed refuses overlap_com"),
            BadInput("trainer_key", lambda: DeepSpeedZeroStrategy(deepspeed=DeepSpeedOptions(
                     config={"gradient_accumulation_steps": 4})), ValueError,
                     r"set from Trainer\(accumulate_grad_batches=\.\.\.\)"),
            BadInput("compressor", lambda: DeepSpeedZeroStrategy(1, compression="powersgd"), ValueError,
                     r"can only communicate gradients in a lower precision"),
            BadInput("bucket", lambda: DeepSpeedOptions(reduce_bucket_size=0), ValueError,
                     r"DeepSpeedOptions\(reduce_bucket_size=0\)`: must be >= 1"),
        ),
    ),
    Setting(name="ds_zero3_gpt", model=_tiny_gpt_dropout, data=_tiny_shakespeare, trainer_kwargs=_deepspeed(3)),
    # Gradient compression. Resume is exact: error-feedback buffers, PowerSGD factors and the step
    # counter (which seeds stochastic rounding) are checkpointed per rank.
    Setting(
        name="ddp_powersgd_gpt",
        model=_tiny_gpt,
        data=_tiny_shakespeare,
        trainer_kwargs=lambda: {"strategy": CompressedDDPStrategy(PowerSGD(rank=2))},
        bad_inputs=(
            BadInput("powersgd_rank", lambda: PowerSGD(rank=0), ValueError,
                     r"`PowerSGD\(rank=0\)` is not supported: rank must be an integer >= 1"),
            BadInput("topk_ratio_zero", lambda: TopK(ratio=0), ValueError, r"`TopK\(ratio=0\)` is not supported"),
            BadInput("topk_ratio_big", lambda: TopK(ratio=1.5), ValueError, r"ratio must be in \(0, 1\]"),
            BadInput("quantize_bits", lambda: Quantize(bits=3), ValueError, r"`Quantize\(bits=3\)`.*8 or 4"),
            BadInput("cast_dtype", lambda: Cast("fp8"), ValueError, r"`Cast\(dtype='fp8'\)`"),  # type: ignore[arg-type]
            BadInput("unknown_name", lambda: CompressedDDPStrategy("zip"), ValueError,
                     r"`CompressedDDPStrategy\(compression='zip'\)` is not supported"),
            BadInput("own_hook", lambda: CompressedDDPStrategy("topk", ddp_comm_hook=print), ValueError,
                     r"ddp_comm_hook=...\)` is not supported: the strategy registers its own"),
            BadInput("zero3_topk", lambda: ZeroStrategy(stage=3, compression="topk"), ValueError,
                     r"`ZeroStrategy\(stage=3, compression=TopK\(.*\)\)` is not supported.*Use stage=2"),
            BadInput("zero2_offload_topk", lambda: ZeroStrategy(stage=2, offload_optimizer=True, compression="topk"),
                     ValueError, r"offload_optimizer=True, compression=TopK.*Drop offload_optimizer"),
        ),
    ),
    Setting(name="ddp_topk_cnn", model=_tiny_cnn, data=_tiny_fashion,
            trainer_kwargs=lambda: {"strategy": CompressedDDPStrategy(TopK(0.05))}),
    Setting(name="ddp_int4_gpt", model=_tiny_gpt, data=_tiny_shakespeare,
            trainer_kwargs=lambda: {"strategy": CompressedDDPStrategy(Quantize(4))}),
    Setting(name="zero1_onebit_gpt", model=_tiny_gpt_dropout, data=_tiny_shakespeare,
            trainer_kwargs=lambda: {"strategy": ZeroStrategy(stage=1, min_wrap_params=1000, compression=OneBit())}),
    # ZeRO-2's compressed reduce-scatter: error feedback kept per rank (in place), checkpointed per rank.
    Setting(name="zero2_topk_gpt", model=_tiny_gpt_dropout, data=_tiny_shakespeare,
            trainer_kwargs=lambda: {"strategy": ZeroStrategy(stage=2, min_wrap_params=1000, compression=TopK(0.05))}),
    Setting(name="zero2_fp16_cnn", model=_tiny_cnn, data=_tiny_fashion,
            trainer_kwargs=lambda: {"strategy": ZeroStrategy(stage=2, min_wrap_params=1000, compression="fp16")}),
    # Knowledge distillation: logit KD with an annealed alpha and a FitNets hint (its projection is trained and
    # checkpointed), and a teacher sharded with the student under ZeRO-3.
    Setting(
        name="kd_features_cnn",
        model=_tiny_cnn,
        data=_tiny_fashion,
        trainer_kwargs=_kd_cnn,
        bad_inputs=(
            BadInput("temperature", lambda: KnowledgeDistillation(FashionCNN(), temperature=0), ValueError,
                     r"`KnowledgeDistillation\(temperature=0\)`: temperature must be > 0"),
            BadInput("teacher_call", lambda: KnowledgeDistillation(FashionCNN(), options=DistillationOptions(
                     teacher_call="forward")), TypeError, r"`DistillationOptions\(teacher_call='forward'\)`: pass a "
                     "function"),  # type: ignore[arg-type]
            BadInput("alpha", lambda: KnowledgeDistillation(FashionCNN(), alpha=1.5), ValueError,
                     r"`KnowledgeDistillation\(alpha=1.5\)`: must be in \[0, 1\]"),
            BadInput("alpha_end",
                     lambda: KnowledgeDistillation(FashionCNN(), options=DistillationOptions(alpha_end=-1)),
                     ValueError, r"alpha_end=-1\)`: must be in \[0, 1\]"),
            BadInput("feature_weight",
                     lambda: KnowledgeDistillation(FashionCNN(), options=DistillationOptions(feature_weight=-1.0)),
                     ValueError, r"DistillationOptions\(feature_weight=-1.0\)`: must be >= 0"),
            BadInput("teacher_type", lambda: KnowledgeDistillation(3), TypeError,  # type: ignore[arg-type]
                     r"`KnowledgeDistillation\(teacher=int\)`: pass an nn.Module"),
            BadInput("features_and_cache", lambda: KnowledgeDistillation(FashionCNN(), features={"a": "b"}, cache="x"),
                     ValueError, r"the cache stores logits only"),
        ),
    ),
    Setting(name="kd_zero3_gpt", model=_tiny_gpt, data=_tiny_shakespeare, trainer_kwargs=_kd_zero3_gpt),
    # Pruning: gradual global magnitude pruning with lottery-ticket rewinding, and movement pruning of sharded
    # weights.
    Setting(
        name="prune_ddp_cnn",
        model=_tiny_cnn,
        data=_tiny_fashion,
        trainer_kwargs=_prune_ddp_cnn,
        bad_inputs=(
            BadInput("sparsity_one", lambda: MagnitudePruning(1.0), ValueError,
                     r"MagnitudePruning\(sparsity=1.0\): must be a fraction in \[0, 1\)"),
            BadInput("nm_indivisible", _nm_named_cnn, ValueError,
                     r"pattern='2:4'\) cannot apply to: features\.0\.weight"),
            BadInput("schedule_fraction", lambda: PruningSchedule(end=2.0), ValueError, r"PruningSchedule\(end=2.0\)"),
        ),
    ),
    Setting(name="prune_zero3_gpt", model=_tiny_gpt, data=_tiny_shakespeare, trainer_kwargs=_prune_zero3_gpt,
            mask_slack=0.01, replicated_twin=lambda: "ddp"),
    Setting(
        name="structured_ddp_cnn",
        model=_tiny_cnn,
        data=_tiny_fashion,
        trainer_kwargs=_structured_ddp_cnn,
        bad_inputs=(
            BadInput("amount_one", lambda: StructuredPruning(1.0), ValueError,
                     r"StructuredPruning\(amount=1.0\): must be a fraction in \[0, 1\)"),
            BadInput("attention_heads", lambda: StructuredPruning(0.5, attention_heads="yes"), TypeError,  # type: ignore[arg-type]
                     r"StructuredPruning\(attention_heads='yes'\): pass True"),
            BadInput("importance", lambda: StructuredPruning(0.5, importance="l1"), ValueError,  # type: ignore[arg-type]
                     r"StructuredPruning\(importance='l1'\)"),
        ),
    ),
    # Rows for the rest of what the README lists: fusion, DeepSpeed stage 1 (BatchNorm buffers broadcast every
    # step), offload variants (on CPU they warn and run the offload code paths: FSDP2 for stage 2), the unbiased
    # compressors on DDP, a bf16 reduce-scatter at ZeRO-3, the distillation cache, N:M pruning.
    Setting(name="fusion_ddp_gpt", model=_tiny_gpt, data=_tiny_shakespeare, trainer_kwargs=_fusion_ddp_gpt),
    Setting(name="ds_zero1_cnn", model=_tiny_cnn, data=_tiny_fashion, trainer_kwargs=_deepspeed(1)),
    Setting(name="zero2_offload_cnn", model=_tiny_cnn, data=_tiny_fashion,
            trainer_kwargs=lambda: {"strategy": ZeroStrategy(stage=2, min_wrap_params=1000, offload_optimizer=True)}),
    Setting(name="zero3_offload_gpt", model=_tiny_gpt_dropout, data=_tiny_shakespeare,
            trainer_kwargs=lambda: {"strategy": ZeroStrategy(stage=3, min_wrap_params=1000, offload_params=True)}),
    Setting(name="ddp_int8_gpt", model=_tiny_gpt, data=_tiny_shakespeare,
            trainer_kwargs=lambda: {"strategy": CompressedDDPStrategy(Quantize(8))}),
    Setting(name="ddp_fp16_cnn", model=_tiny_cnn, data=_tiny_fashion,
            trainer_kwargs=lambda: {"strategy": CompressedDDPStrategy(Cast("fp16"))}),
    Setting(name="zero3_bf16cast_gpt", model=_tiny_gpt_dropout, data=_tiny_shakespeare,
            trainer_kwargs=lambda: {"strategy": ZeroStrategy(stage=3, min_wrap_params=1000, compression=Cast("bf16"))},
            ddp_atol=2e-3),
    Setting(name="kd_cache_cnn", model=_tiny_cnn, data=_tiny_fashion, trainer_kwargs=_kd_cache_cnn),
    Setting(name="nm_ddp_gpt", model=_tiny_gpt, data=_tiny_shakespeare, trainer_kwargs=_nm_ddp_gpt),
    # Mixed precision at stages 1-2: bf16 replicas and gradient buckets, fp32 masters in the optimizer state (the
    # checkpoint holds them, so resume is exact); BatchNorm's buffers stay fp32 under autocast.
    Setting(name="zero1_mixed_gpt", model=_tiny_gpt_dropout, data=_tiny_shakespeare,
            trainer_kwargs=lambda: {**_zero(1)(), "precision": "bf16-mixed"}),
    Setting(name="zero2_mixed_cnn", model=_tiny_cnn, data=_tiny_fashion,
            trainer_kwargs=lambda: {**_zero(2)(), "precision": "bf16-mixed"}),
    # bf16-mixed at stage 3 on a CNN with batch norms: FSDP2 gathers bf16 weights, the norms' in fp32 (bf16 ones met
    # their fp32 running statistics), the units' inputs left to autocast; DDP under bf16-mixed is its twin (stage 1's
    # bf16 replicas compute differently). DeepSpeed's bf16 on the same CNN: the batch norms' statistics in bf16, its
    # forward under autocast.
    # What the module's weights are written by between steps under bf16 replicas: pruning masks (they become the
    # masters at the next step) and Lightning's EMA of the fp32 masters; both in the checkpoint, resumed exactly.
    Setting(name="prune_zero2_mixed_cnn", model=_tiny_cnn, data=_tiny_fashion,
            trainer_kwargs=lambda: {**_prune_ddp_cnn(), **_zero(2)(), "precision": "bf16-mixed"}),
    Setting(name="ema_zero2_mixed_gpt", model=_tiny_gpt_dropout, data=_tiny_shakespeare,
            trainer_kwargs=lambda: {**_zero(2)(), "precision": "bf16-mixed", "callbacks": [_ema()]}),
    Setting(name="zero3_mixed_cnn", model=_tiny_cnn, data=_tiny_fashion,
            trainer_kwargs=lambda: {**_zero(3)(), "precision": "bf16-mixed"}, replicated_twin=lambda: "ddp"),
    Setting(name="ds_zero2_mixed_cnn", model=_tiny_cnn, data=_tiny_fashion,
            trainer_kwargs=lambda: {**_deepspeed(2)(), "precision": "bf16-mixed"}),
    # Tensor and pipeline parallelism: the 2 ranks split one model replica (the blocks' linears, or the blocks into
    # stages), compared with DDP ranks that all step on the same batches. ZeRO-1 at tp=2 with sequence parallelism:
    # the FSDP2 path of stages 1-2 (a one-rank data axis here), the norms on the split activation; the pipeline at its
    # defaults (1F1B, 4 micro-batches of the batch of 8).
    Setting(name="tp2_sp_zero1_gpt", model=_tiny_gpt, data=_tiny_shakespeare,
            trainer_kwargs=_model_parallel(stage=1, tensor_parallel=2, sequence_parallel=True),
            replicated_twin=_OneReplicaDDP),
    Setting(name="pp2_gpt", model=_tiny_gpt, data=_tiny_shakespeare,
            trainer_kwargs=_model_parallel(pipeline_parallel=2), replicated_twin=_OneReplicaDDP),
    # A model we did not write, split: Hugging Face Llama at tp=2 with sequence parallelism (heads from `head_dim`,
    # grouped-query key/value projections split by their own heads, the model's rotary angles arriving whole).
    Setting(name="tp2_sp_llama", model=_hf_llama, data=_tiny_shakespeare,
            trainer_kwargs=_model_parallel(stage=3, tensor_parallel=2, sequence_parallel=True),
            replicated_twin=_OneReplicaDDP),
    # compression="auto": timed trials first (a 16-bit all-reduce, then PowerSGD), then one exchange for the run; the
    # trials' progress, times and choice are checkpointed per rank, so a kill inside a trial resumes it. margin=0.99
    # makes the choice the dense one whatever the timings: a row must end the same way in every run.
    Setting(name="ddp_auto_gpt", model=_tiny_gpt, data=_tiny_shakespeare,
            trainer_kwargs=lambda: {"strategy": CompressedDDPStrategy(
                AutoCompression(("fp16", PowerSGD(rank=2)), trial_steps=2, margin=0.99))}),
    # The hierarchical exchange: 2 "nodes" x 2 ranks, dense within a node, PowerSGD across nodes by each parameter's
    # owner; the owners' error buffers and factors are checkpointed per rank.
    Setting(name="ddp_hier_powersgd_gpt", model=_tiny_gpt, data=_tiny_shakespeare_4_ranks, num_nodes=2,
            trainer_kwargs=lambda: {"strategy": CompressedDDPStrategy(PowerSGD(rank=2))}),
)  # fmt: skip


def by_name(name: str) -> Setting:
    for s in SETTINGS:
        if s.name == name:
            return s
    raise KeyError(name)
