"""The planner behind ``bigtrain plan``: per-device memory and communication of each strategy, and a pick.

Model states follow what this package's strategies hold (the ZeRO formulas of Rajbhandari et al., 2020,
with the dtypes of the chosen precision); activations are measured by a forward and backward pass on fake
tensors (no memory, no data) in the precision's dtypes: 16-bit weights and inputs for the ``-true`` precisions
and BF16Precision, autocast to 16 bits for the ``-mixed`` ones. The fake tensors live on CPU, so CPU autocast's
op lists apply; CUDA's runs a few more ops in fp32 on 16-bit inputs (softmax, layer and group norm). Bytes sent
per step are counted as the strategies count them (ring equivalent: (N-1)/N of each gathered output or
reduce-scattered input; an all-reduce twice that), from the same bucket and sharding-unit layout the strategies
build; communication time uses the latency-bandwidth model of ring collectives (Thakur et al., "Optimization of
collective communication operations in MPICH", 2005): a ring step costs ``alpha + bytes / beta``, an all-gather
or reduce-scatter takes N-1 steps of M/N bytes, an all-reduce 2(N-1). Across nodes the ring is limited by the
inter-node link. The method card, with the planner against measured runs, is ``docs/planning.md``.

Compressed rows (``ddp_<compressor>``, ``zero1_<compressor>``, ``zero2_<compressor>`` and ``zero3_fp16``) use each
compressor's own byte formula per parameter (``Compressor.sent_bytes``, at stage 2
``Compressor.reduce_scatter_bytes``; dense fp32/grad-dtype all-reduce or reduce-scatter for what it leaves dense),
add the error-feedback buffer to the gradients' memory, and leave out the time spent compressing. They are lossy,
so the recommendation is taken among the dense rows and a note names the fastest compressed row that fits when it
is faster.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from lightning_bigtrain.engines.flat_shard import norm_parameters
from lightning_bigtrain.functional.compression import COMPRESSION_NAMES
from lightning_bigtrain.functional.memory import parse_bytes
from lightning_bigtrain.planning.parallel import estimate_pipeline, estimate_tensor_parallel
from lightning_bigtrain.planning.parallel import layouts as tensor_parallel_layouts
from lightning_bigtrain.warnings import BigtrainWarning

__all__ = [
    "COMPRESSED_STRATEGIES",
    "STRATEGIES",
    "Cluster",
    "Plan",
    "PlanRow",
    "Workload",
    "parse_bandwidth",
    "parse_bytes",
    "plan",
    "zero_paper_bytes",
]

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
# bf16 moves the bytes fp16 does: one row stands for both.
_COMPRESSORS = tuple(name for name in COMPRESSION_NAMES if name != "bf16")
#: Compressed rows: (base row, compressor name from ``lightning_bigtrain.compression.COMPRESSION_NAMES``).
COMPRESSED_STRATEGIES: dict[str, tuple[str, str]] = {
    **{f"ddp_{c}": ("ddp", c) for c in _COMPRESSORS},
    **{f"zero1_{c}": ("zero1", c) for c in _COMPRESSORS},
    **{f"zero2_{c}": ("zero2", c) for c in _COMPRESSORS},
    "zero3_fp16": ("zero3", "fp16"),
}
# Registered strategy name for each row.
STRATEGY_NAMES = {
    "ddp": "ddp",
    "zero1": "bigtrain_zero1",
    "zero2": "bigtrain_zero2",
    "zero3": "bigtrain_zero3",
    "zero2_offload": "bigtrain_zero2_offload",
    "zero3_offload": "bigtrain_zero3_offload",
}


def strategy_config(row: str, activation_checkpointing: bool = False) -> str | dict[str, Any]:
    """How ``bigtrain fit`` names a plan row's strategy: a registered name, or for ``zero{S}_tp{T}[_sp]`` /
    ``zero{S}_pp{P}`` the class with its arguments (only some degrees are registered). With
    ``activation_checkpointing`` (a plan that counted it) the ZeRO rows' class with ``activation_checkpointing=True``,
    so that the run checkpoints the blocks the plan's memory assumed checkpointed.

    Raises:
        ValueError: ``"ddp"`` with ``activation_checkpointing``: Lightning's DDP does not checkpoint activations.
    """
    match = re.fullmatch(r"zero([123])_(tp|pp)(\d+)(_sp)?", row)
    args: dict[str, Any]
    if match:
        key = "tensor_parallel" if match.group(2) == "tp" else "pipeline_parallel"
        args = {"stage": int(match.group(1)), key: int(match.group(3))}
        if match.group(4):
            args["sequence_parallel"] = True
    elif activation_checkpointing and row.startswith("zero"):
        stage = int(row[4])
        args = {"stage": stage}
        if row.endswith("_offload"):
            args.update(offload_optimizer=True, offload_params=stage == 3)
    elif activation_checkpointing:
        raise ValueError(
            f"Plan row {row!r} with activation checkpointing: Lightning's DDP does not checkpoint activations. "
            "Take a ZeRO row (`ZeroStrategy(stage=1, activation_checkpointing=True)` keeps DDP's replicated "
            "parameters), or checkpoint the blocks in the model yourself (torch.utils.checkpoint)."
        )
    else:
        return STRATEGY_NAMES[row]
    if activation_checkpointing:
        args["activation_checkpointing"] = True
    return {"class_path": "lightning_bigtrain.strategies.ZeroStrategy", "init_args": args}


# Bytes per element of (parameters, gradients, each fp32-state element) held by the strategies per precision.
# Lightning's "-mixed" precisions autocast over fp32 parameters (DDP; ZeRO-3 and offload keep fp32 shards; ZeRO-1/2
# hold 16-bit replicas with fp32 masters instead, see `flat_row` in `_plan`); "-true" hold everything in 16 bits;
# "bigtrain-bf16-kahan" / "-stochastic" are BF16Precision's (bf16 states, Kahan buffer 2 bytes).
_PRECISIONS: dict[str, tuple[int, int, float, int]] = {
    # precision: (param bytes, grad bytes, optimizer-state bytes per fp32 state byte, extra state bytes)
    "32-true": (4, 4, 1.0, 0),
    "32": (4, 4, 1.0, 0),
    "16-mixed": (4, 4, 1.0, 0),
    "bf16-mixed": (4, 4, 1.0, 0),
    "16-true": (2, 2, 0.5, 0),
    "bf16-true": (2, 2, 0.5, 0),
    "bigtrain-bf16-kahan": (2, 2, 0.5, 2),
    "bigtrain-bf16-stochastic": (2, 2, 0.5, 0),
}
# The dtype the forward computes in per precision, and whether by autocast (over fp32 weights) or with the weights
# and inputs cast to it (Lightning's "-true" precisions and BF16Precision).
_COMPUTE: dict[str, tuple[torch.dtype | None, bool]] = {
    "32-true": (None, False),
    "32": (None, False),
    "16-mixed": (torch.float16, True),
    "bf16-mixed": (torch.bfloat16, True),
    "16-true": (torch.float16, False),
    "bf16-true": (torch.bfloat16, False),
    "bigtrain-bf16-kahan": (torch.bfloat16, False),
    "bigtrain-bf16-stochastic": (torch.bfloat16, False),
}
# fp32 optimizer-state bytes per parameter.
_OPTIMIZERS = {"adamw": 8, "adam": 8, "sgd": 4, "sgd-nomomentum": 0, "adagrad": 4, "rmsprop": 4}
_RATE_UNITS = {"bps": 1 / 8, "kbps": 1e3 / 8, "mbps": 1e6 / 8, "gbps": 1e9 / 8, "tbps": 1e12 / 8,
               "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9}  # fmt: skip
_BUCKET_BYTES = 25 * 2**20  # DDP's and FlatShardedOptimizer's bucket size


def parse_bandwidth(value: str | int | float, name: str = "inter_node_bandwidth") -> float:
    """``"25Gbps"`` (bits per second), ``"12.5GB/s"`` (bytes per second) or bytes per second -> bytes/s."""
    if isinstance(value, int | float):
        return float(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z/]*)\s*", value)
    unit = match.group(2) if match else ""
    key = unit.lower()
    # Case matters between bits and bytes: "Gbps"/"Gb/s" are bits, "GB/s" bytes.
    if unit.endswith("B/s"):
        key = unit[:-3].lower() + "b/s"
    elif unit.endswith("b/s"):
        key = unit[:-3].lower() + "bps"
    if not match or key not in _RATE_UNITS:
        raise ValueError(
            f"`{name}={value!r}`: not a bandwidth. Write bits per second (bps, Kbps, Mbps, Gbps, Tbps) or "
            "bytes per second (B/s, KB/s, MB/s, GB/s), e.g. '25Gbps' or '400GB/s'."
        )
    return float(match.group(1)) * _RATE_UNITS[key]


def zero_paper_bytes(stage: int, num_params: int, world_size: int, optimizer_state_bytes: int = 12) -> float:
    """Model states per device in mixed precision as in Rajbhandari et al. (2020), Fig. 1: 2 bytes of 16-bit
    parameters, 2 of 16-bit gradients and K = ``optimizer_state_bytes`` of fp32 master weights and Adam
    moments (K = 12) per parameter, sharded by stage: 0 (DDP) (4+K)Ψ; 1 (4 + K/N)Ψ; 2 (2 + (2+K)/N)Ψ;
    3 (4+K)Ψ/N."""
    psi, n, k = num_params, world_size, optimizer_state_bytes
    return {0: (4 + k) * psi, 1: (4 + k / n) * psi, 2: (2 + (2 + k) / n) * psi, 3: (4 + k) * psi / n}[stage]


@dataclass(frozen=True)
class PlanRow:
    """One strategy's prediction, per device (bytes; seconds per optimizer step)."""

    strategy: str
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    transient_bytes: float
    host_bytes: float
    comm_bytes_per_step: float
    comm_seconds_per_step: float
    offload_seconds_per_step: float
    fits: bool
    bubble_fraction: float = 0.0  # pipeline rows: the schedule's idle fraction of compute (not in the seconds)

    @property
    def model_states_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> float:
        return self.model_states_bytes + self.activation_bytes + self.transient_bytes

    @property
    def seconds_per_step(self) -> float:
        """The part of a step the strategy adds: communication and host transfers (compute is the same)."""
        return self.comm_seconds_per_step + self.offload_seconds_per_step


@dataclass
class Plan:
    """The planner's answer: ``rows[strategy]`` for each strategy, and the recommended one."""

    rows: dict[str, PlanRow]
    num_params: int
    world_size: int
    device_memory: int
    precision: str
    activation_checkpointing: bool
    recommendation: str | None
    notes: list[str] = field(default_factory=list)
    cluster: Cluster | None = None
    workload: Workload | None = None

    def __getitem__(self, strategy: str) -> PlanRow:
        return self.rows[strategy]

    def table(self) -> str:
        """A plain-text table, one line per strategy (GiB per device; milliseconds per step)."""
        head = (f"{'strategy':<14} {'states':>8} {'activ.':>8} {'peak':>8} {'host':>8} {'sent/step':>10} "
                f"{'comm ms':>8} fits")  # fmt: skip
        lines = [head, "-" * len(head)]
        for name, r in self.rows.items():
            mark = "yes" if r.fits else "no"
            if name == self.recommendation:
                mark += "  <- recommended"
            lines.append(
                f"{name:<14} {_gib(r.model_states_bytes):>8} {_gib(r.activation_bytes):>8} {_gib(r.peak_bytes):>8} "
                f"{_gib(r.host_bytes):>8} {_gib(r.comm_bytes_per_step):>10} {1e3 * r.seconds_per_step:>8.1f} {mark}"
            )
        lines.append(f"(GiB per device; {self.world_size} devices with {_gib(self.device_memory)} GiB each)")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def trainer_config(self, devices: int | None = None, num_nodes: int | None = None) -> dict[str, Any]:
        """The recommended Trainer arguments, as ``bigtrain fit`` reads them under ``trainer:``; ``devices`` and
        ``num_nodes`` default to the plan's :class:`Cluster`."""
        if self.recommendation is None:
            raise ValueError("No configuration fits; see `Plan.notes` for what would.")
        if devices is None or num_nodes is None:
            if self.cluster is None:
                raise ValueError("`Plan.trainer_config()`: give `devices` and `num_nodes` (the plan has no Cluster).")
            devices = self.cluster.devices if devices is None else devices
            num_nodes = self.cluster.num_nodes if num_nodes is None else num_nodes
        config: dict[str, Any] = {"devices": devices, "num_nodes": num_nodes,
                                  "strategy": strategy_config(self.recommendation,
                                                              self.activation_checkpointing)}  # fmt: skip
        if self.precision.startswith("bigtrain-bf16-"):
            # BF16Precision is a plugin; Lightning refuses it together with a `precision=` flag.
            compensation = self.precision.removeprefix("bigtrain-bf16-")
            config["plugins"] = [{"class_path": "lightning_bigtrain.plugins.BF16Precision",
                                  "init_args": {"compensation": compensation}}]  # fmt: skip
        else:
            config["precision"] = self.precision
        return config

    def chart(self, path: str) -> str:
        """Save a stacked bar chart of the memory breakdown per strategy as PNG (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise ImportError("`Plan.chart` needs matplotlib: `pip install lightning_bigtrain[test]`.") from err
        names = [n for n in self.rows if n in STRATEGIES]  # memory differs little with compression
        parts = {
            "parameters": [self.rows[n].params_bytes for n in names],
            "gradients": [self.rows[n].grads_bytes for n in names],
            "optimizer states": [self.rows[n].optimizer_bytes for n in names],
            "activations": [self.rows[n].activation_bytes for n in names],
            "transient buffers": [self.rows[n].transient_bytes for n in names],
        }
        fig, ax = plt.subplots(figsize=(8, 4))
        bottom = [0.0] * len(names)
        for label, values in parts.items():
            gib = [v / 2**30 for v in values]
            ax.bar(names, gib, bottom=bottom, label=label)
            bottom = [b + g for b, g in zip(bottom, gib, strict=True)]
        ax.axhline(self.device_memory / 2**30, color="black", linestyle="--", label="device memory")
        ax.set_ylabel("GiB per device")
        ax.set_title(f"{self.num_params / 1e6:.1f}M parameters, {self.precision}, {self.world_size} devices")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return path


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def _positive_int(value: Any) -> int | None:
    """``value`` as an int if it is an integer >= 1 (Python's or numpy's, not a bool), else None."""
    if isinstance(value, bool):
        return None
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if number >= 1 else None


def _count(instance: Any, name: str) -> None:
    """Check that field ``name`` is an integer >= 1 and store it as a Python int."""
    value = getattr(instance, name)
    number = _positive_int(value)
    if number is None:
        raise ValueError(f"`{type(instance).__name__}({name}={value!r})`: must be an int >= 1.")
    object.__setattr__(instance, name, number)


def _flag(who: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"`{who}({name}={value!r})`: pass True or False.")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The hardware a :func:`plan` is for. Sizes and rates take units (``"80GB"``, ``"24GiB"``, ``"25Gbps"``,
    ``"400GB/s"``) or plain numbers (bytes, bytes per second); every field is checked when the object is made.

    Attributes:
        devices: Devices per node.
        num_nodes: Nodes.
        device_memory: Memory per device, e.g. ``"80GB"``.
        intra_node_bandwidth: Link between devices of a node, e.g. ``"300GB/s"``.
        inter_node_bandwidth: Link between nodes, e.g. ``"25Gbps"``.
        host_bandwidth: Device <-> host copies of offloaded states, e.g. ``"25GB/s"``.
        host_memory: Host memory per node for offloaded states (all of a node's devices share it); ``None``
            leaves it unchecked.
        latency: Seconds per ring step (alpha).
        accelerator: ``"cuda"`` or ``"cpu"`` (on CPU offloading moves nothing: offload rows equal stage 3).
    """

    devices: int
    num_nodes: int = 1
    device_memory: str | int = "80GB"
    intra_node_bandwidth: str | float = "300GB/s"
    inter_node_bandwidth: str | float = "25Gbps"
    host_bandwidth: str | float = "25GB/s"
    host_memory: str | int | None = None
    latency: float = 10e-6
    accelerator: str = "cuda"

    def __post_init__(self) -> None:
        who = type(self).__name__
        _count(self, "devices")
        _count(self, "num_nodes")
        if parse_bytes(self.device_memory, "device_memory") <= 0:
            raise ValueError(f"`{who}(device_memory={self.device_memory!r})`: must be above 0 bytes.")
        for name in ("intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth"):
            if parse_bandwidth(getattr(self, name), name) <= 0:
                raise ValueError(f"`{who}({name}={getattr(self, name)!r})`: must be above 0.")
        if self.host_memory is not None:
            parse_bytes(self.host_memory, "host_memory")
        if isinstance(self.latency, bool) or not isinstance(self.latency, int | float) or not self.latency >= 0:
            raise ValueError(f"`{who}(latency={self.latency!r})`: seconds per ring step, a number >= 0.")
        if self.accelerator not in ("cuda", "cpu"):
            raise ValueError(f"`{who}(accelerator={self.accelerator!r})`: choose 'cuda' or 'cpu'.")

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What a :func:`plan` trains: input, precision, optimizer and memory options. Every field is checked when
    the object is made.

    Attributes:
        batch_shape: Per-device input batch shape, e.g. ``(32, 128)``; needed to measure activations.
        input_dtype: Input dtype (``torch.long`` for token models).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd-nomomentum"``, ``"adagrad"``, ``"rmsprop"``.
        precision: As Lightning spells it (``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``,
            ...), or ``"bigtrain-bf16-kahan"`` / ``"bigtrain-bf16-stochastic"`` for BF16Precision. Activations
            are measured in its dtypes (see the module docstring).
        activation_checkpointing: Count activations as if each repeated block were checkpointed.
        compression: Add the compressed rows (:data:`COMPRESSED_STRATEGIES`; PowerSGD rows need a model).
    """

    batch_shape: tuple[int, ...] | None = None
    input_dtype: torch.dtype = torch.long
    optimizer: str = "adamw"
    precision: str = "32-true"
    activation_checkpointing: bool = False
    compression: bool = True

    def __post_init__(self) -> None:
        who = type(self).__name__
        if self.batch_shape is not None:
            shape = self.batch_shape
            sequence = isinstance(shape, Sequence) and not isinstance(shape, str)
            dims = [_positive_int(d) for d in shape] if sequence else []
            if not dims or None in dims:
                raise ValueError(f"`{who}(batch_shape={shape!r})`: a shape of ints >= 1, e.g. (32, 128).")
            object.__setattr__(self, "batch_shape", tuple(dims))
        if not isinstance(self.input_dtype, torch.dtype):
            raise TypeError(f"`{who}(input_dtype={self.input_dtype!r})`: a torch.dtype, e.g. torch.long.")
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"`{who}(optimizer={self.optimizer!r})`: choose one of {', '.join(_OPTIMIZERS)}.")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"`{who}(precision={self.precision!r})`: choose one of {', '.join(_PRECISIONS)}.")
        _flag(who, "activation_checkpointing", self.activation_checkpointing)
        _flag(who, "compression", self.compression)


_D = TypeVar("_D", Cluster, Workload)


def _from_keywords(cls: type[_D], given: dict[str, Any]) -> _D:
    """``cls(**given)`` for :func:`plan`'s keyword form; its errors name ``plan(...)``, where the value was given."""
    try:
        return cls(**given)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace(f"`{cls.__name__}(", "`plan(", 1)) from None


class _Lifetimes:
    """Live bytes of every storage the fake forward and backward create, in the order ops create and free them.

    Fake tensors keep their Python object for as long as the tensor lives (also when only autograd holds
    it), so a finalizer per tensor tells when its storage is released. Events name storages by a serial
    number: a released storage's ``id`` can be reused by a later one.
    """

    def __init__(self, ignore: set[int]) -> None:
        self.ignore = ignore  # parameter and buffer storages (model states)
        self.entries: dict[int, list[Any]] = {}  # id(storage) -> [storage, bytes, live tensors, serial]
        self.events: list[tuple[int, float]] = []  # (serial, +bytes created / -bytes released)

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.ignore:
            return
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = [storage, float(storage.nbytes()), 0, len(self.events)]
            self.events.append((entry[3], entry[1]))
        entry[2] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.entries[key]
        entry[2] -= 1
        if entry[2] == 0:
            self.events.append((entry[3], -entry[1]))
            del self.entries[key]

    def serial(self, t: torch.Tensor) -> int | None:
        """The serial of a live tensor's storage (None if not tracked)."""
        entry = self.entries.get(id(t.untyped_storage()))
        return None if entry is None else int(entry[3])

    def peak(self, exclude: set[int | None]) -> float:
        """Highest live total, not counting the storages whose serials are in ``exclude``."""
        live = peak = 0.0
        for serial, delta in self.events:
            if serial not in exclude:
                live += delta
                peak = max(peak, live)
        return peak


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors created without a dtype get ``dtype`` (as in Lightning's ``-true`` precisions' forward)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def measure_activations(
    model: nn.Module,
    example: torch.Tensor,
    *,
    checkpoint_blocks: Sequence[nn.Module] = (),
    precision: str = "32-true",
    weights_16bit: bool = False,
    split: tuple[Sequence[nn.Module], Sequence[nn.Module], int] | None = None,
    sequence_blocks: Sequence[nn.Module] = (),
    breakdown: dict[str, Any] | None = None,
) -> tuple[float, float, float]:
    """Bytes the forward pass saves for backward (activations), measured on fake tensors: without and
    with activation checkpointing of ``checkpoint_blocks`` (each block then keeps only its input, and the
    largest block's activations are live again while it is recomputed in backward); and the working set:
    the most bytes live at once during forward and backward (saved activations still held, gradients of
    activations, temporaries), parameter gradients excluded since they are model states.

    The pass runs in ``precision``'s dtypes: for the ``-true`` precisions (and BF16Precision's) on 16-bit copies
    of the weights, buffers and floating inputs, with 16 bits as the default dtype; for the ``-mixed`` ones under
    CPU autocast to 16 bits, so the 16-bit copies of the weights that the layers keep for backward count too,
    unless ``weights_16bit`` (ZeRO-1/2 in mixed precision hold the trainable weights but those of normalization
    layers in 16 bits: no copies).

    ``split=(columns, rows, T)``: tensor parallelism's per-rank share. What is saved between a column-split module's
    output and the end of the row-split module that closes its region (attention's heads, the MLP's hidden
    activation, the row module's input) is split ``T`` ways; the rest is whole on every rank. With ``sequence_blocks``
    (sequence parallelism), what those blocks save outside the split regions (norms, dropout, residual additions) is
    split ``T`` ways too, but for what a column-split module saves of its own input (gathered whole before it).

    ``breakdown``: a dict filled with ``"before"`` (bytes saved before the first of ``checkpoint_blocks`` runs),
    ``"blocks"`` (each block's), ``"after"`` (the rest), and ``"hidden"`` (the bytes of the first block's first
    input): a pipeline stage's share and message (planner rows ``zero3_pp{P}``).

    Parameters are not counted (they are model states). Raises on models that cannot run on fake tensors.
    """
    if precision not in _COMPUTE:
        raise ValueError(f"`measure_activations(precision={precision!r})`: choose one of {', '.join(_COMPUTE)}.")
    dtype, autocast = _COMPUTE[precision]
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    saved: dict[int, float] = {}
    param_storages: set[int] = set()
    per_block: list[float] = []
    block_inputs: list[float] = []
    lifetimes = _Lifetimes(param_storages)

    class Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    lifetimes.track(t)
            return out

    def storage_key(t: torch.Tensor) -> int:
        # The storage object is cached on the tensor, and pack() keeps every saved tensor alive.
        return id(t.untyped_storage())

    inside = [0]  # split regions open (tensor parallelism): a column module's output until its row module's end
    in_sequence = [0]  # inside a sequence-parallel block
    in_column = [0]  # inside a column-split module's own forward (its input is gathered whole)
    share = 1 if split is None else split[2]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in param_storages and key not in saved:
            divided = inside[0] or (in_sequence[0] and not in_column[0])
            saved[key] = t.untyped_storage().nbytes() / (share if divided else 1)
        return t

    def total() -> float:
        return float(sum(saved.values()))

    hooks = []
    starts: list[float] = []
    for block in checkpoint_blocks:
        start: list[float] = []

        def before(module: nn.Module, args: tuple[Any, ...], start: list[float] = start) -> None:
            start.append(total())
            starts.append(start[-1])
            if breakdown is not None and "hidden" not in breakdown and args and isinstance(args[0], torch.Tensor):
                breakdown["hidden"] = float(args[0].numel() * args[0].element_size())
            block_inputs.append(float(sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))))

        def after(module: nn.Module, args: tuple[Any, ...], out: Any, start: list[float] = start) -> None:
            per_block.append(total() - start[-1])

        hooks += [block.register_forward_pre_hook(before), block.register_forward_hook(after)]
    if split is not None:
        columns, rows, _ = split

        def open_region(*_: Any) -> None:
            inside[0] = 1

        def close_region(*_: Any) -> None:
            inside[0] = 0

        hooks += [m.register_forward_hook(open_region) for m in columns]
        hooks += [m.register_forward_hook(close_region) for m in rows]
        if sequence_blocks:

            def flag(cell: list[int], value: int) -> Any:
                def hook(*_: Any) -> None:
                    cell[0] += value

                return hook

            for cell, modules in ((in_sequence, sequence_blocks), (in_column, columns)):
                for m in modules:
                    hooks += [m.register_forward_pre_hook(flag(cell, 1)), m.register_forward_hook(flag(cell, -1))]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:

            def fake(t: torch.Tensor) -> torch.Tensor:
                f = mode.from_tensor(t)
                cast = dtype is not None and not autocast and f.is_floating_point()
                return f.to(dtype).detach() if cast else f  # fake: the real tensors are not copied

            params = {n: fake(p).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
            if weights_16bit and dtype is not None:  # as ZeroStrategy holds them: normalization layers stay fp32
                kept = {id(p) for p in norm_parameters(model)}
                cast = {n for n, p in model.named_parameters() if p.requires_grad and id(p) not in kept}
                params = {n: p.detach().to(dtype).requires_grad_() if n in cast else p for n, p in params.items()}
            buffers = {n: fake(b) for n, b in model.named_buffers()}
            for t in (*params.values(), *buffers.values()):
                param_storages.add(storage_key(t))
            x = fake(example)
            if dtype is None:
                context: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            else:
                context = torch.autocast("cpu", dtype=dtype) if autocast else _default_dtype(dtype)
            with Track():
                with context:  # the forward and the loss, as in a training step; backward outside, as in a run
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        out = torch.func.functional_call(model, {**params, **buffers}, (x,))
                    loss = (out if isinstance(out, torch.Tensor) else out[0]).float().mean()
                del out
                loss.backward()
                del loss
            grads = {lifetimes.serial(p.grad) for p in params.values() if p.grad is not None}
            working = lifetimes.peak(exclude=grads)
    finally:
        for h in hooks:
            h.remove()
    plain = total()
    if breakdown is not None and per_block:
        breakdown["before"] = float(starts[0])
        breakdown["blocks"] = list(per_block)
        breakdown["after"] = plain - float(starts[0]) - sum(per_block)
    if not checkpoint_blocks or not per_block:
        return plain, plain, max(working, plain)
    checkpointed = plain - sum(per_block) + sum(block_inputs) + max(per_block)
    return plain, checkpointed, max(working, plain)


def _pipeline_rows(
    model: nn.Module,
    degree: int,
    n: int,
    batch_shape: tuple[int, ...] | None,
    input_dtype: torch.dtype,
    precision: str,
    p_bytes: int,
    g_bytes: int,
    state_per_param: float,
    step_bytes: int,
    beta: float,
    latency: float,
    memory: float,
    notes: list[str],
) -> list[PlanRow]:
    """``zero{S}_pp{degree}`` for S = 1, 2, 3: the model cut into ``degree`` pipeline stages (1F1B, ``2 x degree``
    micro-batches), each stage's blocks on ZeRO-S across the ``n / degree`` pipelines; the busiest rank's figures
    (:class:`~lightning_bigtrain.planning.parallel.PipelineEstimate`). The three hold the same states at rest; stages
    1-2 keep the stage's blocks gathered through the step (stage 1 also their whole gradients, reduce-scattered once
    per step), so they send less and hold more. With one pipeline (nothing sharded) only the ``zero3_pp`` row."""
    name = f"zero3_pp{degree}"
    example = torch.zeros(tuple(batch_shape), dtype=input_dtype) if batch_shape is not None else None
    try:
        est = estimate_pipeline(model, degree, n, example, precision=precision)
    except Exception as err:  # no block container, too few blocks, an indivisible batch: no row
        notes.append(f"{name}: not estimated ({type(err).__name__}: {err})")
        return []
    dp = est.data_parallel
    worst: dict[int, PlanRow] = {}
    for r in range(degree):
        p_dev, g_dev = est.numel[r] * p_bytes, est.numel_trainable[r] * g_bytes
        s_dev = est.numel_trainable[r] * state_per_param + est.tensors[r] * step_bytes
        p2p = est.pipeline_bytes(r)
        messages = p2p / est.hidden_bytes if est.hidden_bytes else 0
        reduce = est.reduce_bytes(g_bytes)
        units = sum(len(est.plan.blocks(s)) for s in est.local_stages[r])
        activations = est.activations(r) or 0.0
        unit = est.largest_unit[r]
        for stage in (1, 2, 3) if dp > 1 else (3,):  # one pipeline: nothing is sharded, every stage is ZeRO-3's row
            sharding = est.sharding_bytes(r, p_bytes, g_bytes, stage)
            sent = p2p + reduce + sharding
            per_unit = {3: 3 * est.microbatches, 2: 1 + est.microbatches, 1: 2}[stage]
            collectives = 2 * (degree - 1) + 2 * (dp - 1) + per_unit * units * (dp - 1)
            seconds = (messages + collectives) * latency + sent / beta
            transient = 0.0
            if dp > 1 and stage == 3:  # the gathered block and the prefetched next, and a block's whole gradients
                transient = 2 * unit * p_bytes + unit * g_bytes
            elif dp > 1:  # the stage's blocks gathered through the step; stage 1: their whole gradients too
                transient = est.unit_numel[r] * p_bytes + (est.unit_numel[r] if stage == 1 else unit) * g_bytes
            row = PlanRow(f"zero{stage}_pp{degree}", p_dev, g_dev, s_dev, activations, transient, 0.0, sent, seconds,
                          0.0, fits=False, bubble_fraction=est.bubble)  # fmt: skip
            if stage not in worst or row.peak_bytes > worst[stage].peak_bytes:
                worst[stage] = row
    if example is None:
        notes.append(f"{name}: activations and pipeline bytes need batch_shape (left out)")
    notes.append(f"{name}: the 1F1B schedule idles {100 * est.bubble:.0f}% of compute (bubble), not in its seconds")
    return [PlanRow(**{**row.__dict__, "fits": row.peak_bytes <= memory}) for row in worst.values()]


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    from lightning_bigtrain.functional.sharding import auto_wrap_targets

    return auto_wrap_targets(model, min_params=1)


def plan(
    model_or_num_params: nn.Module | int,
    *,
    cluster: Cluster | None = None,
    workload: Workload | None = None,
    devices: int | None = None,
    num_nodes: int | None = None,
    device_memory: str | int | None = None,
    intra_node_bandwidth: str | float | None = None,
    inter_node_bandwidth: str | float | None = None,
    host_bandwidth: str | float | None = None,
    host_memory: str | int | None = None,
    latency: float | None = None,
    batch_shape: Sequence[int] | None = None,
    input_dtype: torch.dtype | None = None,
    optimizer: str | None = None,
    precision: str | None = None,
    activation_checkpointing: bool | None = None,
    accelerator: str | None = None,
    compression: bool | None = None,
) -> Plan:
    """Predict per-device memory and communication of DDP and each ZeRO variant, and recommend one.

    ``plan(model, cluster=Cluster(devices=8, ...), workload=Workload(batch_shape=(32, 128), ...))``; the fields
    of both can also be given as keywords, ``plan(model, devices=8, batch_shape=(32, 128), ...)`` (one form per
    dataclass: a ``cluster`` together with hardware keywords is refused). The method card is
    ``docs/planning.md``.

    Args:
        model_or_num_params: The model (measured: parameters, sharding units, activations) or a parameter
            count (model states and communication from the formulas only; activations 0).
        cluster: The hardware (:class:`Cluster`); or its fields as keywords: ``devices`` (required then),
            ``num_nodes``, ``device_memory``, ``intra_node_bandwidth``, ``inter_node_bandwidth``,
            ``host_bandwidth``, ``host_memory``, ``latency``, ``accelerator``.
        workload: What is trained (:class:`Workload`; default ``Workload()``); or its fields as keywords:
            ``batch_shape``, ``input_dtype``, ``optimizer``, ``precision``, ``activation_checkpointing``,
            ``compression``.

    Raises:
        ValueError: a field is out of range (the message names it), or both forms were given for one dataclass.
        TypeError: no hardware was given (neither ``cluster`` nor ``devices``).
    """
    hardware = {"devices": devices, "num_nodes": num_nodes, "device_memory": device_memory,
                "intra_node_bandwidth": intra_node_bandwidth, "inter_node_bandwidth": inter_node_bandwidth,
                "host_bandwidth": host_bandwidth, "host_memory": host_memory, "latency": latency,
                "accelerator": accelerator}  # fmt: skip
    training = {"batch_shape": batch_shape, "input_dtype": input_dtype, "optimizer": optimizer,
                "precision": precision, "activation_checkpointing": activation_checkpointing,
                "compression": compression}  # fmt: skip
    cluster = _resolve(Cluster, "cluster", cluster, {k: v for k, v in hardware.items() if v is not None})
    workload = _resolve(Workload, "workload", workload, {k: v for k, v in training.items() if v is not None})
    return _plan(model_or_num_params, cluster, workload)


def _resolve(cls: type[_D], argument: str, given: _D | None, keywords: dict[str, Any]) -> _D:
    """The :class:`Cluster` or :class:`Workload` of a :func:`plan` call, from its object or from its keywords."""
    if given is not None:
        if not isinstance(given, cls):
            raise TypeError(f"`plan({argument}={given!r})`: expected a {cls.__name__}.")
        if keywords:
            raise ValueError(
                f"`plan({argument}=..., {', '.join(f'{k}=...' for k in keywords)})`: give these as fields of the "
                f"{cls.__name__} or as keywords, not both."
            )
        return given
    if cls is Cluster and "devices" not in keywords:
        raise TypeError("plan() needs the hardware: `cluster=Cluster(devices=..., ...)`, or `devices=...`.")
    return _from_keywords(cls, keywords)


def _plan(model_or_num_params: nn.Module | int, cluster: Cluster, workload: Workload) -> Plan:
    devices, num_nodes, accelerator, latency = cluster.devices, cluster.num_nodes, cluster.accelerator, cluster.latency
    host_memory = cluster.host_memory
    batch_shape, input_dtype, optimizer = workload.batch_shape, workload.input_dtype, workload.optimizer
    precision, activation_checkpointing = workload.precision, workload.activation_checkpointing
    compression = workload.compression
    memory = parse_bytes(cluster.device_memory, "device_memory")
    intra = parse_bandwidth(cluster.intra_node_bandwidth, "intra_node_bandwidth")
    inter = parse_bandwidth(cluster.inter_node_bandwidth, "inter_node_bandwidth")
    host = parse_bandwidth(cluster.host_bandwidth, "host_bandwidth")
    host_limit = None if host_memory is None else parse_bytes(host_memory, "host_memory")
    n = devices * num_nodes
    beta = inter if num_nodes > 1 else intra
    p_bytes, g_bytes, s_scale, s_extra = _PRECISIONS[precision]
    state_per_param = _OPTIMIZERS[optimizer] * s_scale + s_extra
    # torch's Adam, AdamW, Adagrad and RMSprop keep a float32 `step` tensor per parameter tensor they update
    # (per flat partition under ZeRO-1/2): counted when the model is given, so the states match the run exactly.
    step_bytes = 4 if optimizer in ("adam", "adamw", "adagrad", "rmsprop") else 0
    tensors = 0
    notes: list[str] = []

    activations = 0.0
    backward_extra = 0.0  # the working set of backward above the saved activations
    activations16: float | None = None  # the same with 16-bit trainable weights (ZeRO-1/2 under "-mixed")
    backward_extra16 = 0.0
    if isinstance(model_or_num_params, nn.Module):
        model = model_or_num_params
        params = [p for p in model.parameters()]
        trainable = [p for p in params if p.requires_grad]
        psi = sum(p.numel() for p in params)
        psi_train = sum(p.numel() for p in trainable)
        blocks = _repeated_blocks(model)
        if batch_shape is not None:
            example = torch.zeros(tuple(batch_shape), dtype=input_dtype)
            try:
                plain, checkpointed, working = measure_activations(model, example, checkpoint_blocks=blocks,
                                                                   precision=precision)  # fmt: skip
                activations = checkpointed if activation_checkpointing else plain
                backward_extra = working - plain
                if precision.endswith("-mixed"):  # ZeRO-1/2's 16-bit replicas: autocast copies none of them
                    plain16, checkpointed16, working16 = measure_activations(
                        model, example, checkpoint_blocks=blocks, precision=precision, weights_16bit=True
                    )
                    activations16 = checkpointed16 if activation_checkpointing else plain16
                    backward_extra16 = working16 - plain16
            except Exception as err:  # any failure to trace falls back to counting
                warnings.warn(
                    f"plan: could not run {type(model).__name__} on fake tensors ({type(err).__name__}: {err}); "
                    "activations are left out and only parameters are counted.",
                    BigtrainWarning,
                    stacklevel=3,  # plan()'s caller
                )
                notes.append("activations not measured (the model could not run on fake tensors)")
        else:
            notes.append("activations not measured (give batch_shape)")
        groups = _param_groups(model, trainable)
        flat_chunks = _flat_chunks(groups, n)
        kept = {id(p) for p in norm_parameters(model)}  # fp32 buckets of their own under "-mixed"
        mixed_chunks = (_flat_chunks([[p for p in g if id(p) not in kept] for g in groups], n),
                        _flat_chunks([[p for p in g if id(p) in kept] for g in groups], n))  # fmt: skip
        psi_kept = sum(p.numel() for p in trainable if id(p) in kept)
        tensors = len(trainable)
        fsdp_numel = _fsdp_padded_numel(model, n)
        fsdp_numel_train = _fsdp_padded_numel(model, n, trainable_only=True)
        largest_unit = float(max([sum(p.numel() for p in b.parameters()) for b in blocks] or [psi]))
    else:
        psi = psi_train = int(model_or_num_params)
        if psi < 1:
            raise ValueError(f"`plan({model_or_num_params!r})`: the parameter count must be >= 1.")
        blocks = []
        buckets = max(1, math.ceil(psi * p_bytes / _BUCKET_BYTES))
        flat_chunks = [math.ceil(psi / buckets / n)] * buckets
        mixed_chunks, psi_kept = (flat_chunks, [0]), 0
        fsdp_numel = fsdp_numel_train = math.ceil(psi / n) * n
        largest_unit = float(min(psi, _BUCKET_BYTES // p_bytes))  # units of about a bucket's size
        notes.append("activations not measured (a parameter count was given, not a model)")

    ring = (n - 1) / n

    def ring_seconds(total_bytes: float, collectives: int, steps_per_collective: int) -> float:
        if n == 1:
            return 0.0
        return collectives * steps_per_collective * (n - 1) * latency + steps_per_collective * ring * total_bytes / beta

    # Sharding units: the repeated blocks plus the root; from a bare count, units of about a bucket's size.
    units = len(blocks) + 1 if blocks else max(1, math.ceil(psi * p_bytes / _BUCKET_BYTES))
    rows: dict[str, PlanRow] = {}
    ddp_buckets = max(1, math.ceil(psi_train * g_bytes / _BUCKET_BYTES))
    # Stages 1-2 under "-mixed" hold the ZeRO paper's layout (16-bit replicas and gradient buckets, fp32 masters in
    # the sharded optimizer state), unless a compressor keeps them in fp32 (compressed zero1 rows).
    mixed = precision.endswith("-mixed")

    def flat_row(stage: int, mixed: bool) -> tuple[float, float, float, float, float, float]:
        """Stages 1-2 on FlatShardedOptimizer: bytes of parameters, gradients, optimizer states and transients,
        bytes sent and seconds per step."""
        if mixed:  # 16-bit buckets with fp32 masters; normalization layers' buckets in fp32
            chunks16, chunks32 = mixed_chunks
            share16, share32 = sum(chunks16), sum(chunks32)
            chunks = [c for c in chunks16 + chunks32 if c]
            share_bytes = 2 * share16 + 4 * share32  # one slice of every bucket
            p_dev = (psi - psi_train) * p_bytes + 2 * (psi_train - psi_kept) + 4 * psi_kept
            g_full = 2 * (psi_train - psi_kept) + 4 * psi_kept
            s_dev = share16 * (state_per_param + 4) + share32 * state_per_param
            extra = 4.0 * share16  # the fp32 gradient slices the optimizer steps with
        else:
            chunks = [c for c in flat_chunks if c]
            share_bytes = sum(flat_chunks) * p_bytes
            p_dev, g_full = psi * p_bytes, psi_train * g_bytes
            s_dev = sum(flat_chunks) * state_per_param
            extra = 0.0
        sent = 2 * ring * share_bytes * n  # reduce-scatter + all-gather of padded buckets
        seconds = ring_seconds(share_bytes * n, max(1, len(chunks)), 2)
        g_dev = g_full if stage == 1 else share_bytes
        s_dev += step_bytes * len(chunks) if tensors else 0
        transient = 0.0 if stage == 1 else min(_BUCKET_BYTES, g_full)  # one staging bucket
        return p_dev, g_dev, s_dev, transient + extra, sent, seconds

    for name in STRATEGIES:
        offload = name.endswith("offload") and accelerator == "cuda"
        stage = {"ddp": 0, "zero1": 1, "zero2": 2}.get(name, 3)
        fsdp = stage == 3 or name.endswith("offload")
        if fsdp:
            # FSDP2 shards each parameter (dim 0 padded to N); zero2_offload keeps parameters gathered
            # between forward and backward, stage 3 gathers them again for backward.
            gathers = 1 if name == "zero2_offload" else 2
            sent = ring * (gathers * fsdp_numel * p_bytes + fsdp_numel_train * g_bytes)
            seconds = ring_seconds(fsdp_numel * p_bytes * gathers, gathers * units, 1)
            seconds += ring_seconds(fsdp_numel_train * g_bytes, units, 1)
            shard = fsdp_numel / n
            p_dev, g_dev, s_dev = shard * p_bytes, shard * g_bytes, shard * state_per_param + tensors * step_bytes
            # The gathered unit and the prefetched next one; in backward also the unit's unsharded gradients
            # until they are reduce-scattered.
            transient = 2 * largest_unit * p_bytes + largest_unit * g_bytes
            if name == "zero2_offload":
                transient = psi * p_bytes  # parameters stay gathered from forward to backward
        elif stage == 0:
            sent = 2 * ring * psi_train * g_bytes
            seconds = ring_seconds(psi_train * g_bytes, ddp_buckets, 2)
            p_dev, g_dev = psi * p_bytes, psi_train * g_bytes
            s_dev = psi_train * state_per_param + tensors * step_bytes
            transient = psi_train * g_bytes  # DDP's gradient buckets (copies of the gradients)
        else:
            p_dev, g_dev, s_dev, transient, sent, seconds = flat_row(stage, mixed)
        row_activations, row_extra = activations, backward_extra
        if mixed and stage in (1, 2) and not fsdp and activations16 is not None:
            row_activations, row_extra = activations16, backward_extra16
        transient += row_extra
        host_bytes = 0.0
        offload_seconds = 0.0
        if offload:
            host_bytes = p_dev + g_dev + s_dev
            offload_seconds = 2 * (p_dev + g_dev) / host  # parameters in, gradients out, every step
            p_dev = g_dev = s_dev = 0.0
        row = PlanRow(name, p_dev, g_dev, s_dev, row_activations, transient, host_bytes, sent, seconds, offload_seconds,
                      fits=False)  # fmt: skip
        fits = row.peak_bytes <= memory and (host_limit is None or host_bytes * devices <= host_limit)
        rows[name] = PlanRow(**{**row.__dict__, "fits": fits})
    if isinstance(model_or_num_params, nn.Module) and devices > 1:
        example_tp = torch.zeros(tuple(batch_shape), dtype=input_dtype) if batch_shape is not None else None
        # Messages in the compute dtype: 16 bits for every precision but fp32's.
        element = 4 if _COMPUTE[precision][0] is None else 2
        for degree in tensor_parallel_layouts(devices):
            name = f"zero3_tp{degree}"
            try:
                est = estimate_tensor_parallel(model_or_num_params, degree, n, example_tp)
            except Exception as err:  # a model the structure rules or the fake run cannot handle: no row
                notes.append(f"{name}: not estimated ({type(err).__name__}: {err})")
                continue
            if not est.plan.splits:
                notes.append(f"{name}: nothing in this model splits (no transformer blocks found)")
                continue
            dp = est.data_parallel
            dp_ring = (dp - 1) / dp
            p_dev, g_dev = est.shard_numel * p_bytes, est.shard_numel_trainable * g_bytes
            s_dev = est.shard_numel_trainable * state_per_param + est.tensors * step_bytes
            dp_total = dp * est.shard_numel
            sent = dp_ring * (2 * dp_total * p_bytes + dp * est.shard_numel_trainable * g_bytes)
            # ZeRO-3 over the data-parallel ranks: parameters gathered twice per unit, gradients reduce-scattered.
            seconds = 3 * units * (dp - 1) * latency + (sent / beta if dp > 1 else 0.0)
            sent += est.tensor_parallel_bytes(element)
            seconds += est.tensor_parallel_seconds(element, intra, latency)
            local_unit = largest_unit / degree  # an upper bound: the split part of a block is 1/T
            row_activations, row_extra = activations, backward_extra
            if example_tp is not None and not activation_checkpointing:
                try:
                    plain_tp, _, working_tp = est.activations(example_tp, precision)
                    row_activations, row_extra = plain_tp, working_tp - plain_tp
                except Exception as err:  # keep the unsplit model's (an upper bound)
                    notes.append(f"{name}: activations of the unsplit model ({type(err).__name__}: {err})")
            gathered_units = 2 * local_unit * p_bytes + local_unit * g_bytes if dp > 1 else 0.0
            transient = gathered_units + row_extra
            row = PlanRow(name, p_dev, g_dev, s_dev, row_activations, transient, 0.0, sent, seconds, 0.0, fits=False)
            rows[name] = PlanRow(**{**row.__dict__, "fits": row.peak_bytes <= memory})
            # ZeRO-1/2 on the data axis (FSDP2, parameters kept gathered from the first forward to the optimizer step):
            # the same states at rest; per optimizer step one gather and one reduce-scatter (no accumulation); the
            # whole split model gathered through the step, and at stage 1 its whole gradients until the step's
            # reduce-scatter (stage 2: one unit's, as stage 3).
            sent_12 = dp_ring * (dp_total * p_bytes + dp * est.shard_numel_trainable * g_bytes)
            seconds_12 = 2 * units * (dp - 1) * latency + (sent_12 / beta if dp > 1 else 0.0)
            seconds_12 += est.tensor_parallel_seconds(element, intra, latency)
            sent_12 += est.tensor_parallel_bytes(element)
            held: dict[int, float] = {}  # what stages 1-2 hold gathered through the step
            for stage in (1, 2):
                held[stage] = 0.0
                if dp > 1:
                    held[stage] = dp_total * p_bytes + (dp * est.shard_numel_trainable if stage == 1
                                                        else local_unit) * g_bytes  # fmt: skip
                row = PlanRow(f"zero{stage}_tp{degree}", p_dev, g_dev, s_dev, row_activations, held[stage] + row_extra,
                              0.0, sent_12, seconds_12, 0.0, fits=False)  # fmt: skip
                rows[row.strategy] = PlanRow(**{**row.__dict__, "fits": row.peak_bytes <= memory})
            if not est.messages:
                notes.append(f"{name}: tensor-parallel bytes need batch_shape (left out)")
            # Sequence parallelism (``sequence_parallel=True``): the same states, activations split between the
            # blocks' split regions too, its collectives instead of the blocks' all-reduces.
            if est.sequence_refused is not None:
                notes.append(f"{name}_sp: no sequence-parallel row ({est.sequence_refused})")
            elif example_tp is not None and not activation_checkpointing:
                try:
                    plain_sp, _, working_sp = est.activations(example_tp, precision, sequence_parallel=True)
                except Exception as err:
                    notes.append(f"{name}_sp: not estimated ({type(err).__name__}: {err})")
                else:
                    # Every stage's row with sequence parallelism's collectives instead of the all-reduces, and its
                    # activations; what each stage holds for the data axis is unchanged.
                    swap = est.tensor_parallel_bytes(element, True) - est.tensor_parallel_bytes(element)
                    swap_s = (est.tensor_parallel_seconds(element, intra, latency, True)
                              - est.tensor_parallel_seconds(element, intra, latency))  # fmt: skip
                    extra_sp = working_sp - plain_sp
                    for stage, holds, sent_s, seconds_s in ((3, gathered_units, sent, seconds),
                                                            (1, held[1], sent_12, seconds_12),
                                                            (2, held[2], sent_12, seconds_12)):  # fmt: skip
                        row = PlanRow(f"zero{stage}_tp{degree}_sp", p_dev, g_dev, s_dev, plain_sp, holds + extra_sp,
                                      0.0, sent_s + swap, seconds_s + swap_s, 0.0, fits=False)  # fmt: skip
                        rows[row.strategy] = PlanRow(**{**row.__dict__, "fits": row.peak_bytes <= memory})
    if isinstance(model_or_num_params, nn.Module) and n > 1:
        for degree in [d for d in range(2, n + 1) if n % d == 0]:
            pipeline_rows = _pipeline_rows(model_or_num_params, degree, n, batch_shape, input_dtype, precision,
                                           p_bytes, g_bytes, state_per_param, step_bytes, beta, latency, memory,
                                           notes)  # fmt: skip
            rows.update((row_pp.strategy, row_pp) for row_pp in pipeline_rows)
    if accelerator == "cpu":
        notes.append("on CPU, offloading has nothing to move: the offload rows are ZeRO-3 (FSDP2) without offload")
    compressed: dict[str, PlanRow] = {}
    if compression and n > 1:
        shapes = ([p.shape for p in trainable] if isinstance(model_or_num_params, nn.Module)
                  else None)  # fmt: skip
        for name, (base, cname) in COMPRESSED_STRATEGIES.items():
            if cname == "powersgd" and shapes is None:
                continue
            base_row, base_g_bytes = rows[base], g_bytes
            if mixed and base == "zero2" and cname == "fp16":
                base_g_bytes = 2  # 16-bit gradient buckets already
            elif mixed and base in ("zero1", "zero2"):
                # A compressor keeps stage 1-2's replicas and gradients in fp32 (the strategy warns so).
                stage = int(base[-1])
                p_dev, g_dev, s_dev, transient, sent, seconds = flat_row(stage, False)
                base_row = PlanRow(base, p_dev, g_dev, s_dev, activations, transient + backward_extra, 0.0,
                                   sent, seconds, 0.0, fits=False)  # fmt: skip
            # CompressedDDPStrategy over several nodes of several devices exchanges hierarchically (its default).
            hierarchy = (devices, num_nodes, intra) if base == "ddp" and devices > 1 and num_nodes > 1 else None
            row = _compressed_row(name, base_row, cname, shapes, psi_train, base_g_bytes, n, beta, latency,
                                  ddp_buckets, hierarchy)  # fmt: skip
            fits = row.peak_bytes <= memory
            compressed[name] = PlanRow(**{**row.__dict__, "fits": fits})
        if shapes is None:
            notes.append("PowerSGD rows need a model (its factors depend on the weight shapes)")
        if devices > 1 and num_nodes > 1:
            notes.append(
                "the ddp_<compressor> rows are hierarchical (CompressedDDPStrategy's default over several nodes): "
                "two dense all-reduces within the node, the compressed exchange across nodes split among the node's "
                "devices; their bytes are both"
            )
    # A pipeline row's bubble costs compute time, which the planner does not model: it is recommended only when
    # nothing else fits.
    fitting = [r for r in rows.values() if r.fits and not r.bubble_fraction] or [r for r in rows.values() if r.fits]
    if activation_checkpointing and any(r.strategy == "ddp" for r in fitting):
        # Its row counts the activations checkpointed, which Lightning's DDP does not do (ZeroStrategy does).
        fitting = [r for r in fitting if r.strategy != "ddp"]
        notes.append(
            "ddp is not recommended with activation checkpointing: Lightning's DDP does not checkpoint activations "
            "(its row assumes the model does); the ZeRO rows' strategies do (activation_checkpointing=True)"
        )
    recommendation = None
    if fitting:
        # The fastest; among those within 2% of it, the simplest (the first in STRATEGIES order).
        best = min(r.seconds_per_step for r in fitting)
        recommendation = next(r.strategy for r in fitting if r.seconds_per_step <= best * 1.02 + 1e-9)
    if recommendation is None:
        smallest = min(rows.values(), key=lambda r: r.peak_bytes)
        notes.append(
            f"nothing fits in {_gib(memory)} GiB per device; the smallest is {smallest.strategy} at "
            f"{_gib(smallest.peak_bytes)} GiB: use devices with at least that much memory, more devices "
            f"(model states shrink with N under zero3), activation checkpointing (`--activation-checkpointing`: "
            f"the strategies' activation_checkpointing=True), a smaller batch"
            + ("" if host_limit is None else f", or more host memory for offloading ({_gib(host_limit)} GiB given)")
        )
    faster = [r for r in compressed.values() if r.fits and recommendation is not None
              and r.seconds_per_step < rows[recommendation].seconds_per_step * 0.98]  # fmt: skip
    if faster:
        best_c = min(faster, key=lambda r: r.seconds_per_step)
        notes.append(
            f"with gradient compression (lossy, error feedback) {best_c.strategy} would communicate in "
            f"{1e3 * best_c.seconds_per_step:.1f} ms per step instead of "
            f"{1e3 * rows[str(recommendation)].seconds_per_step:.1f} ms (compression time not counted)"
        )
    rows.update(compressed)
    return Plan(rows, psi, n, memory, precision, activation_checkpointing, recommendation, notes, cluster, workload)


def _compressed_row(
    name: str,
    base: PlanRow,
    cname: str,
    shapes: list[torch.Size] | None,
    psi_train: int,
    g_bytes: int,
    n: int,
    beta: float,
    latency: float,
    buckets: int,
    hierarchy: tuple[int, int, float] | None = None,
) -> PlanRow:
    """``base`` with its gradient exchange replaced by compressor ``cname`` (see the module docstring).

    ``hierarchy`` (``(devices, num_nodes, intra-node bandwidth)``, DDP rows only): CompressedDDPStrategy's
    hierarchical exchange: the node's mean by a dense all-reduce within the node, the compressed exchange among the
    ``num_nodes`` ranks of each local rank, each device sending its share (``1 / devices``) of the parameters, and a
    second dense all-reduce within the node; error feedback is kept by each parameter's owner only."""
    from lightning_bigtrain.functional.compression import Cast, PowerSGD, allreduce_bytes, reducescatter_bytes

    compressor = COMPRESSION_NAMES[cname]()
    ring = (n - 1) / n
    stage = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[base.strategy]
    if hierarchy is not None:
        if stage != 0:
            raise ValueError("_compressed_row: the hierarchical exchange is CompressedDDPStrategy's (ddp rows)")
        local, nodes, intra = hierarchy
        flat = _compressed_row(name, base, cname, shapes, psi_train, g_bytes, nodes, beta, latency, buckets)
        across = flat.comm_bytes_per_step / local
        within = 2 * allreduce_bytes(psi_train * g_bytes, local)
        waits = flat.comm_seconds_per_step - flat.comm_bytes_per_step / beta  # its latency terms, per bucket
        seconds = waits + across / beta + within / intra + buckets * 2 * 2 * (local - 1) * latency
        state = (flat.grads_bytes - base.grads_bytes) / local
        return PlanRow(name, base.params_bytes, base.grads_bytes + state, base.optimizer_bytes, base.activation_bytes,
                       base.transient_bytes, base.host_bytes, across + within, seconds,
                       base.offload_seconds_per_step, fits=False)  # fmt: skip
    if stage >= 2 and isinstance(compressor, Cast):
        # A low-precision reduce-scatter: the gradient half of the base row's traffic is halved.
        # Stage 2 (flat buckets): the reduce-scatter is half the traffic; stage 3: the gradients' share.
        grad_part = base.comm_bytes_per_step / 2 if stage == 2 else ring * psi_train * g_bytes
        saved = grad_part * max(0.0, 1 - 2 / g_bytes)  # nothing to save when gradients are 16-bit already
        sent = base.comm_bytes_per_step - saved
        seconds = base.comm_seconds_per_step - saved / beta
        return PlanRow(name, base.params_bytes, base.grads_bytes, base.optimizer_bytes, base.activation_bytes,
                       base.transient_bytes, base.host_bytes, sent, seconds, base.offload_seconds_per_step,
                       fits=False)  # fmt: skip
    if shapes is None:  # a bare count: one matrix-free stand-in, compressed as a whole
        shapes = [torch.Size((psi_train,))]
    grad_sent = 0.0
    # Per-rank compression state: error feedback (the all-reduce path stages each step's buffer before committing it:
    # two per tensor; stage 2's are updated in place: one) and PowerSGD's warm-start factors Q (m x rank; the
    # committed and the staged one).
    state = 0.0
    copies = 1 if stage == 2 else 2
    for shape in shapes:
        numel = math.prod(shape)
        if compressor.compressible(shape):
            grad_sent += (compressor.reduce_scatter_bytes if stage == 2 else compressor.sent_bytes)(shape, g_bytes, n)
            state += copies * numel * g_bytes if compressor.error_feedback else 0.0
            if isinstance(compressor, PowerSGD):
                state += 2 * math.prod(shape[1:]) * compressor.rank * g_bytes
        else:  # dense: the all-reduce (stage 2: the reduce-scatter; PowerSGD all-reduces it with its factors)
            dense = reducescatter_bytes if stage == 2 and not isinstance(compressor, PowerSGD) else allreduce_bytes
            grad_sent += dense(numel * g_bytes, n)
    # Latency: per bucket, an all-reduce (2(N-1) steps) or an all-gather / all-to-all (N-1); PowerSGD two
    # all-reduces.
    steps = {"powersgd": 4, "fp16": 2}.get(cname, 1) * (n - 1)
    seconds = buckets * steps * latency + grad_sent / beta
    if stage == 2:  # the ranks agree each step whether its averages were finite: one 4-byte all-reduce
        grad_sent += allreduce_bytes(4, n)
    if stage == 0:
        sent = grad_sent
    else:  # ZeRO-1/2: the parameter all-gather after the step stays dense (half of the base row's traffic)
        sent = grad_sent + base.comm_bytes_per_step / 2
        seconds += base.comm_seconds_per_step / 2
    return PlanRow(name, base.params_bytes, base.grads_bytes + state, base.optimizer_bytes, base.activation_bytes,
                   base.transient_bytes, base.host_bytes, sent, seconds, base.offload_seconds_per_step,
                   fits=False)  # fmt: skip


def _param_groups(model: nn.Module, trainable: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """The trainable parameters grouped as the model's ``configure_optimizers`` groups them (the flat engine
    buckets each group apart); one group when that cannot be called outside a Trainer."""
    configure = getattr(model, "configure_optimizers", None)
    optimizer: Any = None
    if callable(configure):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = configure()
            optimizer = result if isinstance(result, torch.optim.Optimizer) else None
            if optimizer is None and isinstance(result, dict):
                optimizer = result.get("optimizer")
            if optimizer is None and isinstance(result, list | tuple) and result:
                first = result[0]
                optimizer = first[0] if isinstance(first, list | tuple) else first
        except Exception as err:
            # Typically the LR scheduler asks for `self.trainer` after the optimizer was built: take the
            # optimizer from the failed call's frames.
            frame = err.__traceback__
            while frame is not None and optimizer is None:
                optimizer = next(
                    (v for v in frame.tb_frame.f_locals.values() if isinstance(v, torch.optim.Optimizer)), None
                )
                frame = frame.tb_next
    if isinstance(optimizer, torch.optim.Optimizer):
        return [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    return [trainable]


def _flat_chunks(groups: list[list[nn.Parameter]], world: int) -> list[int]:
    """Per-rank partition lengths of FlatShardedOptimizer's buckets, group by group."""
    from lightning_bigtrain.engines.flat_shard import bucket_runs

    chunks = []
    for params in groups:
        if params:
            chunks += [math.ceil(sum(p.numel() for p in run) / world) for run in bucket_runs(params, _BUCKET_BYTES)]
    return chunks or [0]


def _fsdp_padded_numel(model: nn.Module, world: int, trainable_only: bool = False) -> int:
    """Elements FSDP2 all-gathers (or, ``trainable_only``, reduce-scatters) for the whole model: each
    parameter's dim 0 padded to a multiple of N."""
    total = 0
    for p in model.parameters():
        if trainable_only and not p.requires_grad:
            continue
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // max(rows, 1)
        total += math.ceil(rows / world) * world * per_row
    return total
