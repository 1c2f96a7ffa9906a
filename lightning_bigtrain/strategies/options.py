"""Options and validation both ZeRO engines share (:class:`ZeroOptions`, :class:`DeepSpeedOptions`), and
the engine rule of :func:`~lightning_bigtrain.strategies.zero_strategy`.

``zero.py`` (the torch engine) and ``deepspeed_zero.py`` (DeepSpeed's) both import from here and not from
each other.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, get_args

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

__all__ = [
    "STAGES",
    "DeepSpeedOptions",
    "Engine",
    "PipelineOptions",
    "PipelineSchedule",
    "StartMethod",
    "ZeroOptions",
    "check_options",
    "check_stage",
    "deepspeed_available",
    "resolve_engine",
]

StartMethod = Literal["auto", "popen", "spawn", "fork", "forkserver"]
Engine = Literal["torch", "deepspeed", "auto"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
STAGES = (1, 2, 3)


def deepspeed_available() -> bool:
    """Whether DeepSpeed can be imported (without importing it)."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"] is not None
    return importlib.util.find_spec("deepspeed") is not None


@dataclass(frozen=True, kw_only=True)
class DeepSpeedOptions:
    """DeepSpeed's own ZeRO knobs, typed (the ``zero_optimization`` section of its config).

    Attributes:
        overlap_comm: Overlap gradient reduction with backward (stages 2-3; DeepSpeed's default for stage 3).
            ``None`` keeps DeepSpeed's default.
        reduce_bucket_size: Elements per gradient-reduction bucket.
        allgather_bucket_size: Elements per parameter all-gather bucket (stages 1-2).
        contiguous_gradients: Copy reduced gradients into one contiguous buffer (less fragmentation).
        prefetch_bucket_size: Stage 3: elements of parameters fetched ahead of use.
        param_persistence_threshold: Stage 3: parameters with fewer elements stay unpartitioned.
        quantized_weights: ZeRO++ qwZ: all-gather weights as int8 (stage 3; CUDA only: DeepSpeed's
            quantization kernels are CUDA ops).
        quantized_gradients: ZeRO++ qgZ: reduce gradients as int4 with all-to-all (stage 3; CUDA only).
        hierarchical_partition_size: ZeRO++ hpZ: keep a secondary copy of the weights partitioned over
            this many ranks (one node), so that backward's all-gather stays inside the node (stage 3;
            must divide the world size; 1 = off).
        config: Raw DeepSpeed config merged last, for everything else (e.g. ``{"wall_clock_breakdown":
            True}``, ``{"zero_optimization": {"round_robin_gradients": True}}``). Keys DeepSpeed does not
            know are refused. Batch size, gradient accumulation, clipping and precision come from the
            Trainer and may not be set here.
    """

    overlap_comm: bool | None = None
    reduce_bucket_size: int = 200_000_000
    allgather_bucket_size: int = 200_000_000
    contiguous_gradients: bool = True
    prefetch_bucket_size: int | None = None
    param_persistence_threshold: int | None = None
    quantized_weights: bool = False
    quantized_gradients: bool = False
    hierarchical_partition_size: int = 1
    config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("reduce_bucket_size", "allgather_bucket_size", "hierarchical_partition_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`DeepSpeedOptions({name}={getattr(self, name)})`: must be >= 1.")
        if self.config is not None and not isinstance(self.config, Mapping):
            raise TypeError(f"`DeepSpeedOptions(config={self.config!r})`: pass a dict of DeepSpeed config keys.")

    @property
    def zeropp(self) -> list[str]:
        """The ZeRO++ features switched on, by DeepSpeed config key."""
        out = []
        if self.quantized_weights:
            out.append("zero_quantized_weights")
        if self.quantized_gradients:
            out.append("zero_quantized_gradients")
        if self.hierarchical_partition_size > 1:
            out.append("zero_hpz_partition_size")
        return out


@dataclass(frozen=True, kw_only=True)
class ZeroOptions:
    """The rarer knobs of :class:`ZeroStrategy`.

    Attributes:
        save_distributed_checkpoint: Save one shard per rank (a folder); ``False`` gathers a single file
            (stage 3 and offloading only).
        broadcast_buffers: Copy rank 0's buffers (e.g. BatchNorm statistics) to every rank before each
            training step, as DDP does, and once more at the end of training, so replicas and checkpoints agree (a
            run ends as one relaunched from its last checkpoint does). FSDP2 alone leaves them per rank.
        step_seeded_rng: Re-seed torch, ``random`` and NumPy before every training batch from the run's
            seed and the batch index (:func:`~lightning_bigtrain.functional.rng.fold_seed`), so that a
            resumed run draws the same dropout masks as the uninterrupted one. The run's seed (each rank's
            ``torch.initial_seed()`` at setup, i.e. what ``seed_everything`` set) is saved in checkpoints.
            ``False`` leaves the generators alone: resume is then exact only for models that draw no
            random numbers in training.
        start_method: How ranks are launched: ``"popen"`` re-runs the script; ``"fork"`` works from a
            Jupyter kernel; ``"auto"`` picks ``"fork"`` in interactive sessions, else ``"popen"``.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default chosen from the device.
        timeout: Collective timeout.
        async_checkpoint: Write sharded checkpoints in the background (``torch.distributed.checkpoint.
            async_save`` over a separate gloo group): the save copies this rank's shards to host memory and
            returns; the writing thread runs at a lower priority (``nice`` 10) so training keeps the cores;
            the folder is committed (and older checkpoints removed) once every rank has written it,
            checked at each batch start and at the end of training. One save is in flight at a time (the next
            one waits for it), and a preemption checkpoint is written synchronously.
        host_mmap_threshold: Bytes above which host allocations are served by ``mmap`` and returned to the system
            when freed (glibc's ``M_MMAP_THRESHOLD``, set in each rank at setup; on other C libraries nothing is
            done). glibc raises this threshold each time a large block is freed, after which the gathered units,
            gradient buckets and optimizer temporaries of every step come from its heap, where freed memory is kept
            and fragments: the process's resident memory then grows far above what the tensors hold (measured in
            ``benchmarks/zero_memory.py``; docs/zero.md). Fixing the threshold keeps it nearer what is live. Every
            block served by ``mmap`` is new memory the kernel maps and zeroes, page by page, when it is first
            touched: the lower the threshold, the more of each step's allocations pay that. The default, 8 MiB,
            returns the per-step blocks of that size and more (gathered units, gradient and optimizer temporaries
            of large layers) and keeps activation-sized ones in the heap: 128 KiB (the default before) saves more
            resident memory and slows every step more (step time, peak RSS and page faults at each setting:
            ``python -m benchmarks.zero --allocator``, docs/zero.md). Acts when the sharded states are in host
            memory (``accelerator="cpu"`` or offloading); ``None`` leaves the allocator alone. The setting is
            process-wide.
    """

    save_distributed_checkpoint: bool = True
    broadcast_buffers: bool = True
    step_seeded_rng: bool = True
    start_method: StartMethod = "auto"
    process_group_backend: str | None = None
    timeout: timedelta | None = default_pg_timeout
    async_checkpoint: bool = False
    host_mmap_threshold: int | None = 8 * 2**20

    def __post_init__(self) -> None:
        threshold = self.host_mmap_threshold
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0):
            raise ValueError(
                f"`ZeroOptions(host_mmap_threshold={threshold!r})`: give a number of bytes >= 0 (e.g. 8388608), "
                "or None to leave the host allocator alone."
            )
        if self.start_method not in get_args(StartMethod):
            raise ValueError(
                f"`ZeroOptions(start_method={self.start_method!r})`: choose one of {', '.join(get_args(StartMethod))}."
            )


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """How :class:`ZeroStrategy` runs a pipeline (``pipeline_parallel > 1``). See ``docs/parallel.md``.

    Attributes:
        schedule: ``"gpipe"`` (all forwards, then all backwards: activations of every micro-batch held),
            ``"1f1b"`` (one forward, one backward in the steady state: at most ``pipeline_parallel`` micro-batches'
            activations held) or ``"interleaved_1f1b"`` (each rank holds ``stages_per_rank`` stages, spread round
            the ranks: a smaller bubble for more messages). torch.distributed.pipelining's schedules.
        microbatches: How many micro-batches each batch is cut into (the batch size must be divisible by it);
            ``None``: twice the number of pipeline ranks. More micro-batches shrink the bubble
            (``(p - 1) / (v m + p - 1)``) and the activations per micro-batch.
        split_points: The index of the first block of each stage after the first (``stages - 1`` increasing
            indices); ``None`` balances the blocks' parameter counts.
        stages_per_rank: Stages each rank holds; ``"interleaved_1f1b"`` only (then at least 2; default 2).
    """

    schedule: PipelineSchedule = "1f1b"
    microbatches: int | None = None
    split_points: tuple[int, ...] | None = None
    stages_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in get_args(PipelineSchedule):
            raise ValueError(
                f"`PipelineOptions(schedule={self.schedule!r})`: choose one of {', '.join(get_args(PipelineSchedule))}."
            )
        m = self.microbatches
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"`PipelineOptions(microbatches={m!r})`: give an integer >= 1, or None (2 x ranks).")
        v = self.stages_per_rank
        if v is not None:
            if self.schedule != "interleaved_1f1b" and v != 1:
                raise ValueError(
                    f"`PipelineOptions(stages_per_rank={v}, schedule={self.schedule!r})`: several stages per rank "
                    "need schedule='interleaved_1f1b'."
                )
            if self.schedule == "interleaved_1f1b" and (not isinstance(v, int) or v < 2):
                raise ValueError(
                    f"`PipelineOptions(stages_per_rank={v!r}, schedule='interleaved_1f1b')`: give 2 or more "
                    "(1 is schedule='1f1b')."
                )
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))

    @property
    def virtual_stages(self) -> int:
        """Stages per rank: ``stages_per_rank``, or 2 for the interleaved schedule, else 1."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return 2 if self.schedule == "interleaved_1f1b" else 1

    def microbatches_for(self, ranks: int) -> int:
        """The micro-batch count for a pipeline of ``ranks`` ranks."""
        return self.microbatches if self.microbatches is not None else 2 * ranks


def resolve_engine(engine: str, *, stage: int = 3, **kwargs: Any) -> str:
    """The engine ``zero_strategy(engine=...)`` runs on: ``"torch"`` or ``"deepspeed"``.

    ``"auto"``: DeepSpeed when ``deepspeed=DeepSpeedOptions(...)`` is passed (only its engine reads them),
    else the torch engine. The rule follows ``benchmarks/zero.py`` on CPU, where the torch engine was faster at
    every stage and held less per rank (DeepSpeed keeps fp32 master partitions beside fp32 weights); the figures
    are in ``docs/zero.md``. No GPU was measured; choose ``engine="deepspeed"`` explicitly for what only it has
    (ZeRO++, NVMe offload through ``config``, its fused CPU Adam when offloading).
    """
    if engine not in get_args(Engine):
        raise ValueError(f"`zero_strategy(engine={engine!r})`: choose one of {', '.join(get_args(Engine))}.")
    if engine != "auto":
        return engine
    return "deepspeed" if kwargs.get("deepspeed") is not None else "torch"


def check_stage(stage: int, *, offload_params: bool, owner: str) -> None:
    """Refuse a stage outside 1-3, and parameter offload below stage 3 (only stage 3 shards parameters)."""
    if stage not in STAGES:
        raise ValueError(f"`{owner}(stage={stage!r})` is not supported: stage must be 1, 2 or 3.")
    if offload_params and stage != 3:
        raise ValueError(
            f"`{owner}(stage={stage}, offload_params=True)` is not supported: parameters are only "
            "sharded, and so only offloadable, at stage 3. Use stage=3 or offload_optimizer=True."
        )


def check_options(options: ZeroOptions | None, owner: str) -> ZeroOptions:
    """``options`` or the defaults; anything but a :class:`ZeroOptions` is refused."""
    options = ZeroOptions() if options is None else options
    if not isinstance(options, ZeroOptions):
        raise TypeError(
            f"`{owner}(options={options!r})`: pass a `ZeroOptions(...)` (lightning_bigtrain.strategies.ZeroOptions)."
        )
    return options
