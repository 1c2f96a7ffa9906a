"""Gradient compression with error feedback for data-parallel gradient exchange.

Each compressor acts per tensor (per parameter), so what it does never depends on how gradients
happen to be grouped into buckets (DDP regroups them after its first step, and again after a resume);
the gradients of one bucket are exchanged together, in one or two collectives.

* :class:`Cast` — all-reduce in 16 bits (the baseline every claim must beat: Agarwal et al., "On the
  utility of gradient compression in distributed training systems", MLSys 2022).
* :class:`Quantize` — stochastic, unbiased rounding to 8 or 4 bits with one scale per block
  (QSGD, Alistarh et al., NeurIPS 2017), exchanged by all-gather.
* :class:`OneBit` — signs with one scale per tensor, the mean absolute value (EF-SignSGD, Karimireddy
  et al., ICML 2019; the compression of 1-bit Adam, Tang et al., ICML 2021), exchanged by all-gather.
* :class:`TopK` — the largest ``ratio`` of each tensor's entries by magnitude, as values and int32
  indices (Aji & Heafield, EMNLP 2017; Lin et al., "Deep Gradient Compression", ICLR 2018).
* :class:`PowerSGD` — rank-``r`` approximation of each weight matrix by one step of subspace
  iteration warm-started from the previous step (Vogels et al., NeurIPS 2019, Algorithm 1).

Error feedback (Seide et al., Interspeech 2014; Karimireddy et al., 2019) keeps, per rank, what the
compressed message left out and adds it to the next step's gradient; it is on by default for the biased
compressors (TopK, OneBit, PowerSGD) and off for the unbiased or nearly exact ones (Quantize, Cast).

Non-finite gradients (an fp16 overflow under a gradient scaler) reach every rank as non-finite averaged
gradients, so the scaler skips the step everywhere. A step whose averages are not finite anywhere commits
no compression state: error-feedback buffers and PowerSGD factors are staged during the step and kept
only if every bucket came out finite (the same decision on every rank, taken from the averages).

Bytes are counted as a ring collective moves them per rank: an all-reduce of ``B`` bytes sends
``2 (N-1)/N * B``, an all-gather of ``B`` bytes per rank sends ``(N-1) * B``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

if TYPE_CHECKING:
    from lightning_bigtrain.engines.compression import GradientCompression

__all__ = [
    "COMPRESSION_NAMES",
    "COMPRESSORS",
    "Cast",
    "Compressor",
    "OneBit",
    "PowerSGD",
    "Quantize",
    "TopK",
    "allgather_bytes",
    "allreduce_bytes",
    "reducescatter_bytes",
]

CastDtype = Literal["fp16", "bf16"]
_CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def allreduce_bytes(nbytes: int, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of an ``nbytes`` tensor."""
    return 2.0 * (world - 1) / world * nbytes


def reducescatter_bytes(nbytes: int, world: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter of an ``nbytes`` tensor (half an all-reduce)."""
    return (world - 1) / world * nbytes


def allgather_bytes(nbytes: int, world: int) -> float:
    """Bytes one rank sends in a ring all-gather of ``nbytes`` bytes per rank."""
    return float((world - 1) * nbytes)


@dataclass
class _Segment:
    """One parameter's gradient inside a bucket: ``view`` is its flat slice of the bucket buffer."""

    name: str
    index: int
    shape: torch.Size
    view: torch.Tensor


class Compressor:
    """Base class: what is sent for a gradient tensor and how the average is rebuilt.

    Args:
        error_feedback: Keep what each message left out and add it to the next gradient. ``None``
            picks the compressor's default.
        min_compress_numel: Tensors with fewer elements are all-reduced densely in fp32.
        warmup_steps: Optimizer steps exchanged densely before compression starts.
    """

    name = "compressor"
    default_error_feedback = True

    def __init__(
        self, *, error_feedback: bool | None = None, min_compress_numel: int = 0, warmup_steps: int = 0
    ) -> None:
        if min_compress_numel < 0:
            raise ValueError(f"`{type(self).__name__}(min_compress_numel={min_compress_numel})`: must be >= 0.")
        if warmup_steps < 0:
            raise ValueError(f"`{type(self).__name__}(warmup_steps={warmup_steps})`: must be >= 0.")
        self.error_feedback = self.default_error_feedback if error_feedback is None else bool(error_feedback)
        self.min_compress_numel = int(min_compress_numel)
        self.warmup_steps = int(warmup_steps)

    def compressible(self, shape: torch.Size) -> bool:
        """Whether a gradient of this shape is compressed (else all-reduced densely)."""
        return math.prod(shape) >= max(1, self.min_compress_numel)

    def sent_bytes(self, shape: torch.Size, element_size: int, world: int) -> float:
        """Analytic bytes one rank sends for one compressed tensor of ``shape``."""
        raise NotImplementedError

    def reduce_scatter_bytes(self, shape: torch.Size, element_size: int, world: int) -> float:
        """Analytic bytes one rank sends for one compressed tensor of ``shape`` in ZeRO-2's compressed
        reduce-scatter (PowerSGD: its factors' all-reduce, as under DDP)."""
        return self.sent_bytes(shape, element_size, world)

    def exchange(self, engine: GradientCompression, compressed: list[_Segment], dense: list[_Segment]) -> None:
        """Write the rank average of every segment's (error-corrected) gradient into its view."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        """What the compressor itself keeps between steps (checkpointed with each rank's engine state); the
        compressors here keep nothing (their state lives in the engine), ``AutoCompression`` its trials."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    def reset(self) -> None:
        """Forget what :meth:`state_dict` holds: a new engine (a new run) starts here."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._args()})"

    def _args(self) -> str:
        return (
            f"error_feedback={self.error_feedback}, min_compress_numel={self.min_compress_numel}, "
            f"warmup_steps={self.warmup_steps}"
        )


class Cast(Compressor):
    """All-reduce in a 16-bit floating-point type (gradients divided by the world size first, as torch's
    ``fp16_compress_hook`` does, to keep the sum in range). An fp16 overflow gives ``inf`` gradients on
    every rank, which a gradient scaler (``precision="16-mixed"``) skips.

    Args:
        dtype: ``"fp16"`` or ``"bf16"``.
    """

    name = "cast"
    default_error_feedback = False

    def __init__(self, dtype: CastDtype = "fp16", **kwargs: Any) -> None:
        if dtype not in get_args(CastDtype):
            raise ValueError(f"`Cast(dtype={dtype!r})` is not supported: choose 'fp16' or 'bf16'.")
        super().__init__(**kwargs)
        self.dtype = dtype

    def _args(self) -> str:
        return f"{self.dtype!r}, {super()._args()}"

    def sent_bytes(self, shape: torch.Size, element_size: int, world: int) -> float:
        return allreduce_bytes(math.prod(shape) * 2, world)

    def exchange(self, engine: GradientCompression, compressed: list[_Segment], dense: list[_Segment]) -> None:
        engine.allreduce_mean(dense)
        if not compressed:
            return
        world = engine.world
        total = sum(s.view.numel() for s in compressed)
        low = engine.workspace("cast", total, _CAST_DTYPES[self.dtype], compressed[0].view.device)
        offset = 0
        for s in compressed:
            n = s.view.numel()
            mine = low[offset : offset + n]
            if self.error_feedback:
                c = engine.corrected(s).reshape(-1)
                torch.div(c, world, out=mine)  # divided in full precision, rounded once on the way out
                engine.update_error(s, c.sub_(mine.to(c.dtype).mul_(world)))
            else:
                torch.div(s.view, world, out=mine)
            offset += n
        engine.allreduce(low)
        offset = 0
        for s in compressed:
            s.view.copy_(low[offset : offset + s.view.numel()])
            offset += s.view.numel()


class _Gathered(Compressor):
    """Compressors whose messages cannot be summed in place: each rank's payload (bytes) is all-gathered
    and every rank decodes and averages all of them, in rank order (so replicas stay identical)."""

    def payload_nbytes(self, numel: int, element_size: int) -> int:
        raise NotImplementedError

    def encode(self, x: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the payload (uint8, ``payload_nbytes`` long) and the residual ``x - decoded``, where
        ``decoded`` is what receivers will decode from the payload (``x`` may be overwritten by it)."""
        raise NotImplementedError

    def decode_add_(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        """Add the decoded message to ``out`` (flat, the gradient's dtype)."""
        raise NotImplementedError

    def stochastic(self) -> bool:
        return False

    def leading_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the payload's first value (made NaN to pass a non-finite gradient on)."""
        return torch.float32  # a float32 scale

    def sent_bytes(self, shape: torch.Size, element_size: int, world: int) -> float:
        return allgather_bytes(_align(self.payload_nbytes(math.prod(shape), element_size)), world)

    def _message(self, engine: GradientCompression, s: _Segment) -> torch.Tensor:
        """The payload of one segment's error-corrected gradient (its residual kept as the next error)."""
        c = engine.corrected(s).reshape(-1)
        finite = _finite(c)
        generator = engine.generator(s, c.device) if self.stochastic() else None
        payload, residual = self.encode(c, generator)
        if self.error_feedback:
            engine.update_error(s, residual)
        # A non-finite gradient must reach every rank as such (the scaler then skips the step).
        return _poison_if(payload, finite, self.leading_dtype(s.view.dtype))

    def reduce_scatter_bytes(self, shape: torch.Size, element_size: int, world: int) -> float:
        # Each rank's slice goes to that rank alone: (N-1)/N of one message, not N-1 messages.
        return allgather_bytes(_align(self.payload_nbytes(math.prod(shape), element_size)), world) / world

    def exchange(self, engine: GradientCompression, compressed: list[_Segment], dense: list[_Segment]) -> None:
        engine.allreduce_mean(dense)
        if not compressed:
            return
        payloads, sizes = [], []
        for s in compressed:
            payload = self._message(engine, s)
            size = _align(payload.numel())
            payloads.append(torch.nn.functional.pad(payload, (0, size - payload.numel())))
            sizes.append(size)
        gathered = engine.allgather(torch.cat(payloads))  # world x total bytes
        offset = 0
        for s, size in zip(compressed, sizes, strict=True):
            out = s.view.zero_()
            nbytes = self.payload_nbytes(out.numel(), out.element_size())
            for rank in range(engine.world):
                self.decode_add_(gathered[rank, offset : offset + nbytes], out)
            out.div_(engine.world)
            offset += size

    def reduce_scatter(
        self, engine: GradientCompression, pieces: list[list[tuple[_Segment, torch.Size]]], out: torch.Tensor
    ) -> None:
        """ZeRO-2: average into ``out`` (this rank's slice of the bucket) what every rank holds of it. ``pieces[j]``
        are the parts of rank ``j``'s slice with their parameters' shapes: each rank compresses each part (with
        error feedback) and sends rank ``j`` only its parts' payloads; parts of parameters this compressor leaves
        dense travel as their values. Every rank decodes its own slice from all ranks' messages, in rank order."""
        messages, sizes = [], []
        for parts in pieces:
            payloads = []
            for s, shape in parts:
                if self.compressible(shape):
                    payload = self._message(engine, s)
                else:
                    payload = s.view.contiguous().view(torch.uint8)
                payloads.append(torch.nn.functional.pad(payload, (0, _align(payload.numel()) - payload.numel())))
            message = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8, device=out.device)
            messages.append(message)
            sizes.append(message.numel())
        received = engine.all_to_all(torch.cat(messages), sizes)  # world x this rank's message size
        out.zero_()  # the parts' views lie in ``out``
        for rank in range(engine.world):
            offset = 0
            for s, shape in pieces[engine.rank]:
                numel = s.view.numel()
                if self.compressible(shape):
                    nbytes = self.payload_nbytes(numel, s.view.element_size())
                    self.decode_add_(received[rank, offset : offset + nbytes], s.view)
                else:
                    nbytes = numel * s.view.element_size()
                    s.view.add_(received[rank, offset : offset + nbytes].view(s.view.dtype))
                offset += _align(nbytes)
        out.div_(engine.world)


class TopK(_Gathered):
    """Send the ``ratio`` largest-magnitude entries of each tensor (at least one), as values in the
    gradient's dtype and int32 indices; receivers sum the sparse messages. With fp32 gradients and N=2
    ranks that is ``1 / (2 ratio)`` fewer bytes than an fp32 all-reduce (50x at ``ratio=0.01``).

    Args:
        ratio: Fraction of entries sent, in (0, 1].
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01, **kwargs: Any) -> None:
        if not (isinstance(ratio, int | float) and 0 < ratio <= 1):
            raise ValueError(f"`TopK(ratio={ratio!r})` is not supported: ratio must be in (0, 1].")
        super().__init__(**kwargs)
        self.ratio = float(ratio)

    def _args(self) -> str:
        return f"ratio={self.ratio}, {super()._args()}"

    def leading_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # the first value sent

    def k(self, numel: int) -> int:
        return max(1, int(self.ratio * numel))

    def payload_nbytes(self, numel: int, element_size: int) -> int:
        return self.k(numel) * (element_size + 4)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        index = _topk_index(x.abs(), self.k(x.numel()))
        values = x[index]
        payload = torch.cat([values.view(torch.uint8), index.to(torch.int32).view(torch.uint8)])
        return payload, x.index_fill_(0, index, 0)  # the residual: everything not sent

    def decode_add_(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        k = self.k(out.numel())
        split = k * out.element_size()
        values = payload[:split].view(out.dtype)
        index = payload[split:].view(torch.int32).long()
        out.index_add_(0, index, values)


class OneBit(_Gathered):
    """Send each entry's sign as one bit and one scale per tensor, the mean absolute value, so the
    message keeps the tensor's L1 norm (EF-SignSGD). 32x fewer bytes than fp32 at N=2.

    Args:
        block: One scale per ``block`` entries (the mean magnitude of each block) instead of one per tensor:
            closer to the values where magnitudes vary within a tensor, for ``32 / block`` more bits per entry.
            ``None`` (default): one scale per tensor.
    """

    name = "onebit"

    def __init__(self, *, block: int | None = None, **kwargs: Any) -> None:
        if block is not None and block < 2:
            raise ValueError(f"`OneBit(block={block})`: must be None (one scale per tensor) or >= 2.")
        super().__init__(**kwargs)
        self.block = block

    def _args(self) -> str:
        return (f"block={self.block}, " if self.block is not None else "") + super()._args()

    def _blocks(self, numel: int) -> int:
        return 1 if self.block is None else math.ceil(numel / self.block)

    def payload_nbytes(self, numel: int, element_size: int) -> int:
        return 4 * self._blocks(numel) + math.ceil(numel / 8)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.numel()
        positive = x >= 0
        if self.block is None:
            scale = x.abs().mean(dtype=torch.float32).reshape(1)
            s = scale.to(x.dtype)
        else:
            blocks = self._blocks(n)
            padded = torch.nn.functional.pad(x.abs().float(), (0, blocks * self.block - n)).view(blocks, self.block)
            counts = torch.full((blocks,), float(self.block), device=x.device)
            counts[-1] = n - (blocks - 1) * self.block
            scale = padded.sum(dim=1).div_(counts)
            s = scale.to(x.dtype).repeat_interleave(self.block)[:n]
        payload = torch.cat([scale.view(torch.uint8), _pack_bits(positive.view(torch.uint8), 1)])
        decoded = positive.to(x.dtype).mul_(2 * s).sub_(s)  # exactly +s or -s (torch.where is 3x slower here)
        return payload, x.sub_(decoded)

    def decode_add_(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        blocks = self._blocks(out.numel())
        scale = payload[: 4 * blocks].view(torch.float32).to(out.dtype)
        if self.block is not None:
            scale = scale.repeat_interleave(self.block)[: out.numel()]
        bits = _unpack_bits(payload[4 * blocks :], 1, out.numel())
        out.add_(bits.to(out.dtype).mul_(2).sub_(1).mul_(scale))


class Quantize(_Gathered):
    """Stochastic rounding to ``bits``-bit integers with one fp32 scale (the block's largest magnitude)
    per ``block`` entries: unbiased, so error feedback is off by default (QSGD). At N=2 it sends
    ``(bits/8 + 4/block)`` bytes per entry instead of fp32's 4 (``block=256``: 8 bits a quarter, 4 bits an eighth).

    Args:
        bits: 8 or 4.
        block: Entries sharing one scale.
    """

    name = "quantize"
    default_error_feedback = False

    def __init__(self, bits: int = 8, *, block: int = 256, **kwargs: Any) -> None:
        if bits not in (8, 4):
            raise ValueError(f"`Quantize(bits={bits!r})` is not supported: bits must be 8 or 4.")
        if block < 1:
            raise ValueError(f"`Quantize(block={block})`: must be >= 1.")
        super().__init__(**kwargs)
        self.bits = bits
        self.block = block
        self.levels = 2 ** (bits - 1) - 1  # codes -levels..levels, stored shifted by +levels

    def _args(self) -> str:
        return f"bits={self.bits}, block={self.block}, {super()._args()}"

    def stochastic(self) -> bool:
        return True

    def payload_nbytes(self, numel: int, element_size: int) -> int:
        return 4 * math.ceil(numel / self.block) + math.ceil(numel * self.bits / 8)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.numel()
        blocks = math.ceil(n / self.block)
        padded = torch.nn.functional.pad(x.float(), (0, blocks * self.block - n)).view(blocks, self.block)
        scale = padded.abs().amax(dim=1, keepdim=True) / self.levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        noise = torch.rand(padded.shape, generator=generator, device=x.device)
        codes = (padded / safe + noise).floor_().clamp_(-self.levels, self.levels)
        stored = (codes + self.levels).to(torch.uint8).view(-1)[:n]
        payload = torch.cat([scale.view(-1).view(torch.uint8), _pack_bits(stored, self.bits)])
        return payload, x.sub_(codes.mul_(scale).view(-1)[:n].to(x.dtype))

    def decode_add_(self, payload: torch.Tensor, out: torch.Tensor) -> None:
        n = out.numel()
        blocks = math.ceil(n / self.block)
        scale = payload[: 4 * blocks].view(torch.float32)
        codes = _unpack_bits(payload[4 * blocks :], self.bits, n).float().sub_(self.levels)
        codes = torch.nn.functional.pad(codes, (0, blocks * self.block - n)).view(blocks, self.block)
        out.add_((codes * scale.view(-1, 1)).view(-1)[:n].to(out.dtype))


class PowerSGD(Compressor):
    """Rank-``rank`` approximation ``P Q^T`` of each gradient matrix (a tensor viewed as its first
    dimension by the rest), by one power-iteration step warm-started from the last step's ``Q``
    (Vogels et al., 2019): ``P = M Q``, all-reduce ``P``, orthonormalise it, ``Q = M^T P``, all-reduce
    ``Q``. Tensors that are not matrices, or where the factors would not be smaller than the matrix, go
    dense (in the same all-reduce as the ``P`` factors). An ``n x m`` matrix sends ``rank (n + m)``
    instead of ``n m`` values.

    Args:
        rank: Rank of the approximation, >= 1.
    """

    name = "powersgd"

    def __init__(self, rank: int = 4, **kwargs: Any) -> None:
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"`PowerSGD(rank={rank!r})` is not supported: rank must be an integer >= 1.")
        super().__init__(**kwargs)
        self.rank = rank

    def _args(self) -> str:
        return f"rank={self.rank}, {super()._args()}"

    def compressible(self, shape: torch.Size) -> bool:
        if len(shape) < 2 or not super().compressible(shape):
            return False
        n, m = shape[0], math.prod(shape[1:])
        return self.rank * (n + m) < n * m

    def sent_bytes(self, shape: torch.Size, element_size: int, world: int) -> float:
        n, m = shape[0], math.prod(shape[1:])
        return allreduce_bytes(self.rank * (n + m) * element_size, world)

    def exchange(self, engine: GradientCompression, compressed: list[_Segment], dense: list[_Segment]) -> None:
        world = engine.world
        matrices = [engine.corrected(s).reshape(s.shape[0], -1) for s in compressed]
        qs = [engine.factor(s, m.shape[1], self.rank, m.dtype) for s, m in zip(compressed, matrices, strict=True)]
        ps = [m @ q for m, q in zip(matrices, qs, strict=True)]
        # First all-reduce: every P factor and every dense gradient of the bucket together.
        first = torch.cat([p.reshape(-1) for p in ps] + [s.view for s in dense])
        engine.allreduce(first)
        first.div_(world)
        offset = 0
        for p in ps:
            p.copy_(first[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        for s in dense:
            s.view.copy_(first[offset : offset + s.view.numel()])
            offset += s.view.numel()
        if not compressed:
            return
        if not bool(_finite(first[: sum(p.numel() for p in ps)])):
            # Same values on every rank, so every rank takes this branch: pass the overflow on, keep state.
            for s in compressed:
                s.view.fill_(float("nan"))
            return
        ps = [_orthonormalize(p) for p in ps]
        new_qs = [m.T @ p for m, p in zip(matrices, ps, strict=True)]
        second = torch.cat([q.reshape(-1) for q in new_qs])
        engine.allreduce(second)
        second.div_(world)
        offset = 0
        for s, m, p, q in zip(compressed, matrices, ps, new_qs, strict=True):
            q.copy_(second[offset : offset + q.numel()].view_as(q))
            offset += q.numel()
            approx = s.view.view(m.shape)
            torch.matmul(p, q.T, out=approx)  # the same P and Q on every rank: identical averages
            if self.error_feedback:
                engine.update_error(s, m.sub_(approx))
            engine.set_factor(s, q)


COMPRESSORS: dict[str, type[Compressor]] = {
    "cast": Cast,
    "quantize": Quantize,
    "onebit": OneBit,
    "topk": TopK,
    "powersgd": PowerSGD,
}


#: Every compressor name, with its default settings: the one table that ``compression="<name>"``, the registered
#: strategy names (``bigtrain_ddp_<name>``) and the planner's compressed rows are read from.
COMPRESSION_NAMES: dict[str, Callable[[], Compressor]] = {
    "powersgd": lambda: PowerSGD(rank=4),
    "topk": lambda: TopK(ratio=0.01),
    "onebit": OneBit,
    "int8": lambda: Quantize(bits=8),
    "int4": lambda: Quantize(bits=4),
    "fp16": lambda: Cast("fp16"),
    "bf16": lambda: Cast("bf16"),
}


def _finite(x: torch.Tensor) -> torch.Tensor:
    """Whether every entry of ``x`` is finite, as a 0-d bool tensor: one reduction, no temporary mask (a sum
    of finite values only overflows fp32 when gradients near 1e38 appear, which is an overflow in all but name)."""
    return x.sum(dtype=torch.float32).isfinite()


def _topk_index(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries of the 1-D ``magnitude``, exactly as ``topk`` gives them (up to
    the order of ties). For large tensors a threshold estimated on a fixed random sample first keeps about
    ``2k`` candidates (the sampling of Lin et al., ICLR 2018), and ``topk`` runs on those only; if fewer than
    ``k`` pass, it falls back to the full ``topk``. Either way the result is the true top-k."""
    n = magnitude.numel()
    if n < 1 << 16 or 4 * k > n:
        return magnitude.topk(k, sorted=False).indices
    generator = torch.Generator(device=magnitude.device).manual_seed(n)
    samples = min(n, 16384)
    sample = magnitude[torch.randint(n, (samples,), generator=generator, device=magnitude.device)]
    keep = min(samples - 1, max(1, int(samples * 2 * k / n)))
    threshold = sample.topk(keep, sorted=True).values[-1]
    candidates = (magnitude >= threshold).nonzero().squeeze(1)
    if candidates.numel() < k:
        return magnitude.topk(k, sorted=False).indices
    return candidates[magnitude[candidates].topk(k, sorted=False).indices]


def _align(nbytes: int, to: int = 8) -> int:
    return -(-nbytes // to) * to


def _poison_if(payload: torch.Tensor, finite: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Replace the payload's first value by NaN when ``finite`` is False (no host synchronisation)."""
    width = torch.empty(0, dtype=dtype).element_size()
    if payload.numel() < width or not dtype.is_floating_point:
        return payload
    head = payload[:width].view(dtype)
    head = torch.where(finite, head, torch.full_like(head, float("nan")))
    return torch.cat([head.view(torch.uint8), payload[width:]])


def _pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 ``values`` < 2**bits (bits 1 or 4; 8 is returned as is) into bytes, first value highest."""
    if bits == 8:
        return values
    per = 8 // bits
    n = values.numel()
    padded = torch.nn.functional.pad(values, (0, -n % per)).view(-1, per)
    shifts = torch.arange(8 - bits, -1, -bits, device=values.device, dtype=torch.uint8)
    return (padded << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    if bits == 8:
        return packed[:n]
    shifts = torch.arange(8 - bits, -1, -bits, device=packed.device, dtype=torch.uint8)
    mask = (1 << bits) - 1
    return ((packed.view(-1, 1) >> shifts) & mask).view(-1)[:n]


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p`` (reduced QR; deterministic, so identical on every rank)."""
    if p.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.qr(p.float()).Q.to(p.dtype)
    return torch.linalg.qr(p).Q
