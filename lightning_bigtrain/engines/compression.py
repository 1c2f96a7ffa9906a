"""GradientCompression: per-rank state (error feedback, PowerSGD factors, staged commits, byte counters) and the
background exchange thread of compressed gradient averaging (all-reduce: DDP and ZeRO-1; reduce-scatter: ZeRO-2).
The compressors it drives, and the method, are in :mod:`lightning_bigtrain.functional.compression`."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_bigtrain.functional.compression import (
    Compressor,
    _finite,
    _Gathered,
    _Segment,
    allgather_bytes,
    allreduce_bytes,
    reducescatter_bytes,
)
from lightning_bigtrain.functional.rng import fold_seed

__all__ = ["GradientCompression", "NodeGroups"]


@dataclass(frozen=True)
class NodeGroups:
    """The process groups of a hierarchical exchange over ``num_nodes`` nodes of ``local_world`` ranks each (global
    rank ``node * local_world + local_rank``, Lightning's layout): ``intra``, this node's ranks; ``inter``, the ranks
    with this rank's local rank on every node (one per node)."""

    intra: Any
    inter: Any
    local_rank: int
    local_world: int
    node: int
    num_nodes: int

    @classmethod
    def build(cls, local_world: int, num_nodes: int) -> NodeGroups:
        """Create the groups (a collective: every rank calls it, in the same order)."""
        world = dist.get_world_size()
        if local_world * num_nodes != world:
            raise ValueError(
                f"NodeGroups.build: {num_nodes} nodes x {local_world} ranks is not the world size {world}."
            )
        node, local_rank = divmod(dist.get_rank(), local_world)
        # Every rank creates every group (new_group is collective over the default group), keeping its own.
        intra = [dist.new_group(list(range(n * local_world, (n + 1) * local_world))) for n in range(num_nodes)]
        inter = [dist.new_group([n * local_world + j for n in range(num_nodes)]) for j in range(local_world)]
        return cls(intra[node], inter[local_rank], local_rank, local_world, node, num_nodes)


class GradientCompression:
    """Per-rank state and transport of compressed gradient averaging: error-feedback buffers and PowerSGD
    factors keyed by parameter name, a step counter (warm-up, seeds), and byte counters.

    Buckets are exchanged on one background thread in the order they are handed over, so compression
    and communication overlap the rest of backward while every rank issues the same collectives in the
    same order. (Chaining collectives inside ``torch.futures`` callbacks, as torch's PowerSGD hook does,
    can block gloo's own worker threads.)

    Args:
        compressor: What to send.
        module: The model whose parameters' gradients are exchanged (names key the state).
        group: Process group; the default group if None.
        seed: Base seed of PowerSGD's initial factors (shared by all ranks) and of stochastic rounding
            (folded with rank, step and parameter, so a resumed run draws the same noise).
        sharded: ZeRO-2 (:meth:`reduce_scatter`): each rank keeps only its slice of the averaged gradients, so the
            error-feedback buffers are updated in place (one fp32 copy of the gradients per rank, not the two of the
            all-reduce path's staged commit); after a step whose averages were not finite on some rank they restart
            from zero on every rank.
        nodes: A hierarchical exchange (:meth:`exchange_now`): dense within each node, compressed across nodes.
            Each parameter has one owner among a node's ranks (:attr:`owners`, balanced by size); only the owner
            compresses and sends it across nodes (to its peers with the same local rank), so the bytes crossing the
            inter-node link per step are one compressed copy of the gradients per node. The compressor's transport
            (:meth:`allreduce`, :meth:`allgather`, :attr:`world`, :attr:`rank`) is then the inter-node group.
    """

    def __init__(
        self,
        compressor: Compressor,
        module: nn.Module,
        group: Any = None,
        seed: int = 0,
        *,
        sharded: bool = False,
        nodes: NodeGroups | None = None,
    ) -> None:
        if nodes is not None and (sharded or group is not None):
            raise ValueError("GradientCompression: a hierarchical exchange (nodes=...) is the all-reduce path over "
                             "the default group; it takes neither sharded=True nor a group.")  # fmt: skip
        self.compressor = compressor
        compressor.reset()  # a compressor object reused by a second run starts afresh (a checkpoint restores it)
        self.nodes = nodes
        # What every rank takes part in (the trials of AutoCompression agree over it; checkpoints count it).
        self.global_group = group
        self.global_world = dist.get_world_size(group)
        self.group = group if nodes is None else nodes.inter
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.seed = seed
        self.sharded = sharded
        self.step = 0
        self.sent_bytes = 0.0  # cumulative, ring-equivalent, per rank (hierarchical: across nodes)
        self.dense_bytes = 0.0  # what an fp32 all-reduce of the same gradients would have sent (over all ranks)
        self.intra_bytes = 0.0  # hierarchical: the dense all-reduces within the node
        self._names: dict[int, tuple[str, int]] = {}
        for index, (name, p) in enumerate(module.named_parameters()):
            self._names.setdefault(id(p), (name, index))
        #: Hierarchical: the local rank that sends each parameter's gradient across nodes (by name).
        self.owners: dict[str, int] = {} if nodes is None else _owners(module, nodes.local_world)
        self.errors: dict[str, torch.Tensor] = {}
        self.factors: dict[str, torch.Tensor] = {}
        # Other per-rank tensors an optimizer keeps here so that they are checkpointed per rank (as `errors` are).
        self.rank_state: dict[str, torch.Tensor] = {}
        # This step's updates, committed by `advance` only if all its averages were finite.
        self._staged_errors: dict[str, torch.Tensor] = {}
        self._staged_factors: dict[str, torch.Tensor] = {}
        self._finite: torch.Tensor | None = None
        self._spare: dict[str, torch.Tensor] = {}
        self._workspaces: dict[str, torch.Tensor] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}  # sharded: reduce-scatters of each piece in this step (micro-batches)

    # -- transport helpers used by the compressors (run on the exchange thread) --
    def allreduce(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=self.group)
        self.sent_bytes += allreduce_bytes(tensor.numel() * tensor.element_size(), self.world)

    def allreduce_mean(self, segments: list[_Segment]) -> None:
        if segments:
            self.sent_bytes += _sum_segments(segments, self.group, self.world, self.world)

    def allgather(self, payload: torch.Tensor) -> torch.Tensor:
        out = torch.empty(self.world * payload.numel(), dtype=payload.dtype, device=payload.device)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, payload, group=self.group)
        self.sent_bytes += allgather_bytes(payload.numel() * payload.element_size(), self.world)
        return out.view(self.world, -1)

    def corrected(self, segment: _Segment) -> torch.Tensor:
        """The gradient plus its carried error, in a buffer of this engine's (shaped like the parameter;
        the caller may overwrite it, e.g. with the residual it hands to :meth:`update_error`). Without error
        feedback, the gradient's own view in the bucket."""
        grad = segment.view.view(segment.shape)
        if not self.compressor.error_feedback:
            # Nothing to keep: compressors read (and may scribble on) it before writing the average there.
            return grad
        if self.sharded:
            # In place: the error buffer becomes gradient + error, and the compressor leaves the residual there.
            error = self.errors.get(segment.name)
            if error is None:
                error = self.errors[segment.name] = grad.detach().reshape(-1).clone()
            else:
                if error.device != grad.device:  # restored from a checkpoint on the host
                    error = self.errors[segment.name] = error.to(grad.device)
                error.add_(grad.reshape(-1))
            return error.view(segment.shape)
        out = self._buffer(segment.name, grad)
        error = self.errors.get(segment.name)
        if error is None:
            return out.copy_(grad)
        return torch.add(grad, error.to(grad.device).view(segment.shape), out=out)

    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A recycled tensor shaped like ``like`` (error buffers alternate between two: the committed one
        and the one being written), so steady-state steps allocate no large tensors."""
        spare = self._spare.pop(name, None)
        if spare is None or spare.numel() != like.numel() or spare.dtype != like.dtype or spare.device != like.device:
            return torch.empty_like(like)
        return spare.view(like.shape)

    def param_name(self, p: torch.Tensor) -> str:
        """The name that keys ``p``'s per-rank state (its name in the module)."""
        named = self._names.get(id(p))
        if named is None:
            raise KeyError("GradientCompression.param_name: the parameter is not the module's")
        return named[0]

    def workspace(self, key: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A reused scratch tensor of at least ``numel`` elements (only valid during one exchange)."""
        ws = self._workspaces.get(key)
        if ws is None or ws.numel() < numel or ws.dtype != dtype or ws.device != device:
            ws = self._workspaces[key] = torch.empty(numel, dtype=dtype, device=device)
        return ws[:numel]

    def update_error(self, segment: _Segment, residual: torch.Tensor) -> None:
        """Stage ``residual`` (what this rank's message left out) as the segment's next error (sharded: keep it,
        in the error buffer :meth:`corrected` returned, where compressors leave it)."""
        if self.sharded:
            error = self.errors[segment.name]
            if residual.data_ptr() != error.data_ptr():
                error.copy_(residual.reshape(-1))
            return
        self._staged_errors[segment.name] = residual.reshape(-1)

    def factor(self, segment: _Segment, columns: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """PowerSGD's ``Q`` for this parameter: the last step's, else random, identical on every rank."""
        q = self.factors.get(segment.name)
        if q is not None and q.shape == (columns, rank):
            return q.to(segment.view.device)
        generator = torch.Generator().manual_seed(fold_seed(self.seed, segment.index))
        q = torch.randn(columns, rank, generator=generator, dtype=torch.float32)
        return q.to(dtype=dtype, device=segment.view.device)

    def set_factor(self, segment: _Segment, q: torch.Tensor) -> None:
        self._staged_factors[segment.name] = q

    def generator(self, segment: _Segment, device: torch.device) -> torch.Generator:
        seed = fold_seed(fold_seed(fold_seed(self.seed, self.rank), self.step), segment.index)
        return torch.Generator(device=device).manual_seed(seed)

    # -- the public entry points --
    def segments(
        self, buffer: torch.Tensor, params: list[torch.Tensor], offsets: list[int] | None = None
    ) -> list[_Segment]:
        """Describe a bucket: ``params`` laid out in ``buffer`` at ``offsets`` (contiguous if None)."""
        out, offset = [], 0
        for i, p in enumerate(params):
            start = offset if offsets is None else offsets[i]
            name, index = self._names.get(id(p), (f"<unnamed {i}>", -1 - i))
            out.append(_Segment(name, index, p.shape, buffer[start : start + p.numel()]))
            offset = start + p.numel()
        return out

    def tensor_segments(self, tensors: list[torch.Tensor], params: list[torch.Tensor]) -> list[_Segment]:
        """Describe tensors that are not laid out in one buffer (each contiguous, shaped like its parameter in
        ``params``): the exchange averages each in place, with the parameter's error-feedback state."""
        out = []
        for i, (t, p) in enumerate(zip(tensors, params, strict=True)):
            if not t.is_contiguous() or t.shape != p.shape:
                raise ValueError("tensor_segments needs contiguous tensors shaped like their parameters")
            name, index = self._names.get(id(p), (f"<unnamed {i}>", -1 - i))
            out.append(_Segment(name, index, p.shape, t.view(-1)))
        return out

    def exchange_now(self, segments: list[_Segment]) -> None:
        """Average the segments' gradients over the ranks, in place (blocking).

        Hierarchical (``nodes``): a dense all-reduce within the node makes the node's mean; each rank sends the
        segments it owns across nodes through the compressor (error feedback on the node's mean); a second dense
        all-reduce within the node, of the owned averages (zeros elsewhere), gives every rank the whole average."""
        for s in segments:
            self.dense_bytes += allreduce_bytes(s.view.numel() * 4, self.global_world)
        with torch.no_grad():
            nodes = self.nodes
            if nodes is None:
                self._across(segments)
            else:
                self._within_node(segments, nodes.local_world)
                mine = [s for s in segments if self._owner(s) == nodes.local_rank]
                if mine:  # the same set on every node (owners follow names), so peers call the same collectives
                    self._across(mine)
                owned = {id(s) for s in mine}
                for s in segments:
                    if id(s) not in owned:
                        s.view.zero_()
                self._within_node(segments, None)
            finite = _finite(torch.stack([s.view.sum(dtype=torch.float32) for s in segments]))
            self._finite = finite if self._finite is None else self._finite & finite

    def _across(self, segments: list[_Segment]) -> None:
        """The compressor's exchange over :attr:`group` (dense during its warm-up and for what it leaves dense)."""
        c = self.compressor
        warm = self.step < c.warmup_steps
        compressed = [] if warm else [s for s in segments if c.compressible(s.shape)]
        chosen = {id(s) for s in compressed}
        dense = [s for s in segments if id(s) not in chosen]
        if compressed:
            c.exchange(self, compressed, dense)
        else:
            self.allreduce_mean(dense)

    def _within_node(self, segments: list[_Segment], divisor: int | None) -> None:
        """Sum the segments over this node's ranks in one dense all-reduce (in their dtype), divided by ``divisor``."""
        assert self.nodes is not None
        self.intra_bytes += _sum_segments(segments, self.nodes.intra, self.nodes.local_world, divisor)

    def _owner(self, segment: _Segment) -> int:
        assert self.nodes is not None
        owner = self.owners.get(segment.name)
        return owner if owner is not None else abs(segment.index) % self.nodes.local_world

    def exchange(self, buffer: torch.Tensor, segments: list[_Segment]) -> torch.futures.Future[torch.Tensor]:
        """Start averaging a bucket on the exchange thread; the future's value is ``buffer``, averaged."""

        def run() -> torch.Tensor:
            self.exchange_now(segments)
            return buffer

        return self._submit(run)

    def _submit(self, job: Any) -> torch.futures.Future[torch.Tensor]:
        """Run ``job`` on the exchange thread (jobs run one at a time, in the order submitted)."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bigtrain-compression")

        def run() -> None:
            try:
                with self._lock:
                    result = job()
            except BaseException as err:
                future.set_exception(err)  # type: ignore[arg-type]
            else:
                future.set_result(result)

        self._executor.submit(run)
        return future

    def pieces(
        self, buffer: torch.Tensor, params: list[torch.Tensor], offsets: list[int], chunk: int
    ) -> list[list[tuple[_Segment, torch.Size]]]:
        """A ZeRO-2 bucket cut where the ranks' slices begin: per rank ``j``, the parts of ``params`` (laid out in
        ``buffer`` at ``offsets``) that fall in ``buffer[j * chunk : (j + 1) * chunk]``, each with its parameter's
        shape (what decides whether it is compressed). A part's state is keyed ``"name[a:b]"`` (its range in the
        flattened parameter), and it is compressed on its own (a 1-bit scale, a top-k, per part)."""
        out: list[list[tuple[_Segment, torch.Size]]] = [[] for _ in range(self.world)]
        for i, (p, start) in enumerate(zip(params, offsets, strict=True)):
            n = p.numel()
            if n == 0:
                continue
            name, index = self._names.get(id(p), (f"<unnamed {i}>", 1_000_000 + i))
            for j in range(start // chunk, (start + n - 1) // chunk + 1):
                a, z = max(start, j * chunk), min(start + n, (j + 1) * chunk)
                key = f"{name}[{a - start}:{z - start}]"
                calls = self._calls[key] = self._calls.get(key, -1) + 1  # micro-batches: fresh rounding noise
                seed_index = fold_seed(fold_seed(index, j), calls)
                out[j].append((_Segment(key, seed_index, torch.Size((z - a,)), buffer[a:z]), p.shape))
        return out

    def all_to_all(self, payload: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Send ``payload[sum(sizes[:j]) : sum(sizes[:j + 1])]`` to rank ``j``; returns what every rank sent this
        rank (``world x sizes[rank]``, in rank order). Counts the bytes sent to the other ranks."""
        mine = sizes[self.rank]
        out = torch.empty(self.world * mine, dtype=payload.dtype, device=payload.device)
        dist.all_to_all_single(out, payload, [mine] * self.world, sizes, group=self.group)
        self.sent_bytes += sum(size for j, size in enumerate(sizes) if j != self.rank) * payload.element_size()
        return out.view(self.world, -1)

    def reduce_scatter_now(
        self, buffer: torch.Tensor, params: list[torch.Tensor], offsets: list[int], chunk: int
    ) -> torch.Tensor:
        """ZeRO-2: this rank's slice ``buffer[rank * chunk : (rank + 1) * chunk]`` of the bucket's gradients averaged
        over the ranks, compressed (blocking; the slice is returned, the rest of ``buffer`` is scratch).

        Compressors whose messages are decoded (OneBit, TopK, Quantize) compress each rank's slice separately and
        send it to that rank alone (an all-to-all: ``(N-1)/N`` of one compressed gradient per rank, as a dense
        reduce-scatter sends ``(N-1)/N`` of a dense one); PowerSGD all-reduces its factors as it does under DDP
        (they are small) and each rank rebuilds only its slice's rows' worth of the average. Error feedback acts on
        each rank's whole local gradient before anything is sent. Warm-up steps reduce-scatter densely."""
        c, world = self.compressor, self.world
        lo = self.rank * chunk
        mine = buffer[lo : lo + chunk]
        self.dense_bytes += reducescatter_bytes(buffer.numel() * 4, world)
        with torch.no_grad():
            if self.step < c.warmup_steps:
                reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
                reduce_scatter(mine, buffer, group=self.group)
                self.sent_bytes += reducescatter_bytes(buffer.numel() * buffer.element_size(), world)
                mine.div_(world)
            elif isinstance(c, _Gathered):
                c.reduce_scatter(self, self.pieces(buffer, params, offsets, chunk), mine)
            else:
                segments = self.segments(buffer, params, offsets)
                compressed = [s for s in segments if c.compressible(s.shape)]
                chosen = {id(s) for s in compressed}
                c.exchange(self, compressed, [s for s in segments if id(s) not in chosen])
            finite = _finite(mine.sum(dtype=torch.float32).reshape(1))
            self._finite = finite if self._finite is None else self._finite & finite
        return mine

    def reduce_scatter(
        self, buffer: torch.Tensor, params: list[torch.Tensor], offsets: list[int], chunk: int
    ) -> torch.futures.Future[torch.Tensor]:
        """:meth:`reduce_scatter_now` on the exchange thread; the future's value is this rank's averaged slice."""
        return self._submit(lambda: self.reduce_scatter_now(buffer, params, offsets, chunk))

    def state_bytes(self) -> int:
        """Bytes of this rank's compression state held now: error feedback (the all-reduce path keeps two buffers per
        tensor in steady state, the committed one and the one being written or recycled; sharded, one), PowerSGD
        factors (the committed and the staged ``Q``), optimizer tensors kept per rank."""
        tensors = [*self.errors.values(), *self._staged_errors.values(), *self._spare.values(),
                   *self.factors.values(), *self._staged_factors.values(), *self.rank_state.values()]  # fmt: skip
        seen: dict[tuple[int, torch.device], int] = {}
        for t in tensors:
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), t.device)] = storage.nbytes()
        return sum(seen.values())

    def drop_carried_state(self) -> None:
        """Forget what the compressor carries between steps (error feedback, PowerSGD's factors, recycled buffers),
        as at the start of a run: for a change of compressor between steps (``AutoCompression``)."""
        self.errors.clear()
        self.factors.clear()
        self._spare.clear()

    def advance(self) -> None:
        """End one optimizer step: commit its compression state if all its averages were finite (else
        drop it, as the gradient scaler drops the step), and count it (warm-up and seeds follow the count).
        Sharded, each rank saw only its slice: the ranks agree (one all-reduce of a flag), and after a step that was
        not finite somewhere the error buffers, updated in place, restart from zero."""
        self._calls.clear()
        if self.sharded and self._finite is not None:
            flag = self._finite.to(torch.int32).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            self.sent_bytes += allreduce_bytes(flag.element_size(), self.world)
            self._finite = flag.bool()
            if not bool(self._finite):
                for error in self.errors.values():
                    error.zero_()
        if self._finite is None or bool(self._finite):
            for name, error in self._staged_errors.items():
                old = self.errors.get(name)
                if old is not None:
                    self._spare[name] = old
                self.errors[name] = error
            self.factors.update(self._staged_factors)
        else:
            self._spare.update(self._staged_errors)
        self._staged_errors, self._staged_factors, self._finite = {}, {}, None
        self.step += 1

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: error buffers are per rank; PowerSGD factors are identical on every rank."""
        return {
            "compressor": repr(self.compressor),
            "step": self.step,
            "sent_bytes": self.sent_bytes,
            "dense_bytes": self.dense_bytes,
            "intra_bytes": self.intra_bytes,
            "layout": None if self.nodes is None else [self.nodes.num_nodes, self.nodes.local_world],
            "errors": {k: v.detach().cpu().clone() for k, v in self.errors.items()},
            "factors": {k: v.detach().cpu().clone() for k, v in self.factors.items()},
            "rank_state": {k: v.detach().cpu().clone() for k, v in self.rank_state.items()},
            "compressor_state": self.compressor.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], *, errors: bool = True) -> None:
        """Restore :meth:`state_dict` (tensors move to the gradients' device when first used)."""
        self.step = int(state["step"])
        self.sent_bytes = float(state.get("sent_bytes", 0.0))
        self.dense_bytes = float(state.get("dense_bytes", 0.0))
        self.intra_bytes = float(state.get("intra_bytes", 0.0))
        self.errors = dict(state["errors"]) if errors else {}
        self.factors = dict(state["factors"])
        self.rank_state = dict(state.get("rank_state", {})) if errors else {}
        if "compressor_state" in state:
            self.compressor.load_state_dict(state["compressor_state"])


def _sum_segments(segments: list[_Segment], group: Any, world: int, divisor: int | None) -> float:
    """All-reduce (sum) the segments over ``group`` in one flat tensor, divide by ``divisor`` (None: no division) and
    write them back; returns the bytes one rank sent (ring-equivalent)."""
    flat = torch.cat([s.view for s in segments])
    dist.all_reduce(flat, group=group)
    if divisor is not None:
        flat.div_(divisor)
    offset = 0
    for s in segments:
        s.view.copy_(flat[offset : offset + s.view.numel()])
        offset += s.view.numel()
    return allreduce_bytes(flat.numel() * flat.element_size(), world)


def _owners(module: nn.Module, local_world: int) -> dict[str, int]:
    """Each parameter's owner among a node's ``local_world`` ranks: the largest first, each to the least loaded
    rank (ties to the lowest), so every rank of every node computes the same map and the loads are balanced."""
    load = [0] * local_world
    owners: dict[str, int] = {}
    named = [(name, p.numel(), i) for i, (name, p) in enumerate(module.named_parameters())]
    for name, numel, _ in sorted(named, key=lambda x: (-x[1], x[2])):
        j = min(range(local_world), key=lambda r: (load[r], r))
        owners[name] = j
        load[j] += numel
    return owners
