"""The Lightning side of pipeline parallelism (:class:`PipelineRunner`): micro-batches cut from Lightning's batch, the
user's step run as each stage's function under ``torch.distributed.pipelining``'s schedules, ``self.log`` calls
gathered on the last stage and replayed on every rank, the replicated parameters' gradients summed over the pipeline
group, and clipping by the norm over all stages. The model-side mechanism is
:mod:`lightning_bigtrain.functional.pipeline`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_bigtrain.functional.pipeline import (
    PipelinedBlocks,
    PipelinePlan,
    StageInput,
    StageOutput,
    StageRun,
    simulated_bubble,
)
from lightning_bigtrain.functional.sharding import local_view
from lightning_bigtrain.functional.tensor_parallel import grad_power_sum

if TYPE_CHECKING:
    import lightning as L

    from lightning_bigtrain.strategies.options import PipelineOptions

__all__ = ["PipelineRunner", "split_microbatches"]


def split_microbatches(batch: Any, count: int, owner: str = "pipeline_parallel") -> list[Any]:
    """``batch`` cut into ``count`` equal micro-batches along dim 0 (tensors whose first dimension is the batch's;
    other values are given whole to each)."""
    sizes = {t.shape[0] for t in _tensors(batch) if t.dim() > 0}
    if not sizes:
        raise ValueError(f"{owner}: the batch holds no tensor with a batch dimension to cut into micro-batches.")
    size = max(sizes)
    if size % count:
        raise ValueError(
            f"{owner}: a batch of {size} cannot be cut into {count} equal micro-batches (PipelineOptions("
            f"microbatches={count})). Use a batch size divisible by {count}, or `drop_last=True` in the DataLoader "
            "when the last batch is smaller."
        )

    def cut(value: Any) -> list[Any]:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size:
            return list(value.chunk(count))
        if isinstance(value, dict):
            parts = {k: cut(v) for k, v in value.items()}
            return [type(value)({k: p[i] for k, p in parts.items()}) for i in range(count)]
        if isinstance(value, (list, tuple)):
            parts_seq = [cut(v) for v in value]
            rebuilt = [[p[i] for p in parts_seq] for i in range(count)]
            if hasattr(value, "_fields"):  # a namedtuple
                return [type(value)(*r) for r in rebuilt]
            return [type(value)(r) for r in rebuilt]
        return [value] * count

    return cut(batch)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _loss_of(output: Any, name: str) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, dict) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            f"pipeline_parallel: `{name}` returned {type(output).__name__} on the last stage; it must return the loss "
            "(a tensor, or a dict with 'loss'). Skipping a batch (returning None) is not supported: every stage "
            "has already run it."
        )
    return loss


class _StageCall(nn.Module):
    """The function ``torch.distributed.pipelining`` runs for stage ``index``: the user's step on one micro-batch."""

    def __init__(self, runner: PipelineRunner, index: int) -> None:
        super().__init__()
        self._runner = [runner]  # a list: not a submodule
        self.index = index

    def forward(self, *args: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        runner = self._runner[0]
        incoming = None if self.index == 0 else args[0]
        return runner._run_stage(self.index, incoming, int(mb.item()))


@contextlib.contextmanager
def _refusals_unwrapped(container: str) -> Generator[None, None, None]:
    """torch's schedule wraps a stage's error in its own RuntimeError ("[Stage 0] failed to run forward"); a refusal of
    this package's (the blocks' message) is raised as itself, so the user reads the reason and the fix."""
    try:
        yield
    except RuntimeError as error:
        cause = error.__cause__
        if isinstance(cause, (ValueError, TypeError, RuntimeError)) and str(cause).startswith(
            ("pipeline_parallel", f"`{container}")
        ):
            raise cause from None
        raise


class PipelineRunner:
    """Runs a LightningModule's steps through a pipeline over ``group`` (this rank holds stages
    ``rank, rank + P, ...``).

    Args:
        module: The LightningModule (its block container already replaced by ``blocks``).
        plan: Where it was cut.
        blocks: The stand-in container.
        group: The pipeline group (a rank per pipeline position, in order).
        options: Schedule, micro-batches, stages per rank.
        device: This rank's device.
        data_group: The data-parallel group across pipelines (None: one pipeline): the replicated parameters'
            gradients are averaged over it (the blocks' are reduce-scattered by FSDP2).
    """

    def __init__(
        self,
        module: L.LightningModule,
        plan: PipelinePlan,
        blocks: PipelinedBlocks,
        group: Any,
        options: PipelineOptions,
        device: torch.device,
        data_group: Any = None,
    ) -> None:
        self.module = module
        self.data_group = data_group
        self.plan = plan
        self.blocks = blocks
        self.group = group
        self.options = options
        self.device = device
        self.degree = torch.distributed.get_world_size(group)
        self.rank = torch.distributed.get_rank(group)
        self.stages = plan.stages
        self.local = [s for s in range(self.stages) if s % self.degree == self.rank]
        self.microbatches = options.microbatches_for(self.degree)
        owned = {id(p) for p in blocks.parameters()}
        self.replicated = [p for p in module.parameters() if id(p) not in owned]
        self.owned = [p for p in module.parameters() if id(p) in owned]
        self._schedules: dict[Any, Any] = {}
        self._pending: list[torch.Tensor | None] = []
        self._metas: dict[Any, tuple[torch.Size, Any]] = {}
        self._step: dict[str, Any] = {}
        self.actions: list[tuple[int, str, int, float]] = []  # this rank's last training batch: (stage, F/B, mb, s)
        self.sent_bytes = 0  # activations and gradients this rank has sent to other stages since setup
        self.reduced_bytes = 0.0  # the replicated parameters' gradient all-reduces since setup (ring equivalent)
        self.current: tuple[int, int] | None = None  # (stage, micro-batch) while a stage runs
        # ZeRO-1/2 across pipelines (FSDP2 blocks): the parameters stay gathered until a stage's last backward of the
        # batch (``keep_gathered``); at ZeRO-1 the data-parallel reduction of the gradients waits for it too
        # (``defer_sync``). While Lightning accumulates, neither happens (the strategy's block_backward_sync clears
        # ``sync_allowed``).
        self.keep_gathered = False
        self.defer_sync = False
        self.sync_allowed = True
        self._backwards: dict[int, int] = {}

    # --- the stage function -----------------------------------------------------------------------------------
    def _run_stage(self, stage: int, incoming: torch.Tensor | None, mb: int) -> torch.Tensor:
        step = self._step
        run = StageRun(self.plan.blocks(stage), incoming, stage == self.stages - 1, meta=step["meta"])
        self.blocks.run = run
        self.current = (stage, mb)
        try:
            output = step["fn"](step["microbatches"][mb], *step["rest"])
        except StageOutput as out:
            return out.hidden.contiguous()  # sent as is: a transposed view (batch_first attention) cannot be
        finally:
            self.blocks.run = None
            self.current = None
        if run.calls == 0:
            raise RuntimeError(
                f"pipeline_parallel: `{step['name']}` never called `{self.plan.container}`, so the stages had "
                "nothing to run."
            )
        loss = _loss_of(output, step["name"])
        step["losses"][mb] = loss.detach()
        return loss

    # --- probing -----------------------------------------------------------------------------------------------
    def _meta(self, fn: Callable[..., Any], batch: Any, rest: tuple[Any, ...], name: str) -> tuple[torch.Size, Any]:
        """The blocks' input shape and dtype for ``batch``: the step run up to the container (no gradients)."""
        self.blocks.run = StageRun(probe=True)
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            # Its own random streams: a probe (at the first batch of each shape) must not shift the run's dropout, or a
            # resumed run (which probes again) would draw other masks than the uninterrupted one.
            with torch.no_grad(), self._quiet_log(), torch.random.fork_rng(devices=devices):
                fn(batch, *rest)
        except StageInput as found:
            input_found: StageInput | None = found
        else:
            input_found = None
        finally:
            self.blocks.run = None
        if input_found is None:
            raise RuntimeError(
                f"pipeline_parallel: `{name}` never called `{self.plan.container}`; the pipeline cuts the model there."
            )
        if self.data_group is None:
            # The blocks themselves, on this rank, before any schedule runs: one that changes the shape or returns
            # more tensors is refused here, on every rank with the same message (a rank refused alone would leave
            # the others waiting on it). Across pipelines the blocks are FSDP2 units, whose forward here would gather
            # them: there the refusal comes from the schedule's first forward (:func:`_refusals_unwrapped`), on the
            # ranks whose blocks cause it, and the launcher stops the others.
            with torch.no_grad(), self._quiet_log(), torch.random.fork_rng(devices=devices):
                why = self.blocks.check_stages([self.plan.blocks(s) for s in self.local], input_found)
            verdicts: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(verdicts, why)
            refused = next((v for v in verdicts if v is not None), None)
            if refused is not None:
                raise ValueError(refused)
        return input_found.hidden.shape, input_found.hidden.dtype

    @contextlib.contextmanager
    def _quiet_log(self) -> Generator[None, None, None]:
        self.module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.module.log

    @contextlib.contextmanager
    def _recorded_log(self, records: list[tuple[str, Any, dict[str, Any]]]) -> Generator[None, None, None]:
        from torchmetrics import Metric

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError("pipeline_parallel: pass `self.log`'s options by keyword.")
            if isinstance(value, Metric):
                raise ValueError(
                    f"pipeline_parallel: `self.log({name!r}, <{type(value).__name__}>)`: a metric object is updated on "
                    "the last stage only; log its computed value (a tensor) instead, e.g. `self.log(name, "
                    "metric(preds, target))`."
                )
            records.append((name, value, kwargs))

        self.module.log = log  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.module.log

    # --- training ----------------------------------------------------------------------------------------------
    def _schedule(self, meta: tuple[torch.Size, Any], training: bool) -> Any:
        key = (tuple(meta[0]), meta[1], training)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage
            from torch.distributed.pipelining.schedules import (
                Schedule1F1B,
                ScheduleGPipe,
                ScheduleInterleaved1F1B,
            )

            # requires_grad: the schedule derives the gradient messages' shapes from these (none without it).
            hidden = torch.empty(meta[0], dtype=meta[1], device="meta", requires_grad=training)
            index = torch.empty(1, dtype=torch.int64, device="meta")
            loss = torch.empty((), dtype=torch.float32, device="meta")
            stages = []
            for s in self.local:
                stage = PipelineStage(
                    _StageCall(self, s),
                    s,
                    self.stages,
                    self.device,
                    input_args=(index if s == 0 else hidden,),
                    output_args=(loss if s == self.stages - 1 else hidden,),
                    group=self.group,
                )
                _time_actions(stage, self)
                stages.append(stage)
            kind = self.options.schedule
            loss_fn = self._scaled
            schedule: Any
            if kind == "interleaved_1f1b":
                schedule = ScheduleInterleaved1F1B(list(stages), self.microbatches, loss_fn=loss_fn, scale_grads=False)
            else:
                cls = ScheduleGPipe if kind == "gpipe" else Schedule1F1B
                schedule = cls(stages[0], self.microbatches, loss_fn=loss_fn, scale_grads=False)
            self._schedules[key] = schedule
        return self._schedules[key]

    def _scaled(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """Each micro-batch's loss weighs 1/(micro-batches x accumulated batches) in the gradient, as the whole
        batch's loss would under Lightning's gradient accumulation."""
        return output / (self.microbatches * self._step["accumulate"])

    def train_step(self, name: str, batch: Any, rest: tuple[Any, ...]) -> torch.Tensor:
        """One training batch through the pipeline (forward and backward of every micro-batch); returns the mean
        of the micro-batches' losses on every rank. Gradients are left in ``.grad`` (accumulating)."""
        fn = getattr(self.module, name)
        micro = split_microbatches(batch, self.microbatches)
        key = (name, tuple((tuple(t.shape), t.dtype) for t in _tensors(micro[0])))
        if key not in self._metas:
            self._metas[key] = self._meta(fn, micro[0], rest, name)
        meta = self._metas[key]
        schedule = self._schedule(meta, training=True)
        trainer = self.module.trainer
        losses: dict[int, torch.Tensor] = {}
        records: list[tuple[str, Any, dict[str, Any]]] = []
        self._step = {"fn": fn, "name": name, "microbatches": micro, "rest": rest, "meta": meta, "losses": losses,
                      "accumulate": trainer.accumulate_grad_batches}  # fmt: skip
        self.actions = []
        self._backwards = dict.fromkeys(self.local, 0)
        index = [(torch.tensor([i], device=self.device),) for i in range(self.microbatches)]
        params = self.owned + self.replicated
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        with self._recorded_log(records), _refusals_unwrapped(self.plan.container):
            schedule.step(arg_mbs=index, kwarg_mbs=[{"mb": i[0]} for i in index],
                          target_mbs=[None] * self.microbatches, return_outputs=False)  # fmt: skip
        self._step = {}
        # Lightning zeroes gradients between the step and the backward call: this batch's are handed over then.
        self._pending = [p.grad for p in params]
        for p, grad in zip(params, earlier, strict=True):
            p.grad = grad
        last = self.stages - 1 in self.local
        value = torch.stack([losses[i] for i in range(self.microbatches)]).mean().float() if last else None
        loss = self._replay(value, records, last, self.microbatches)
        return loss

    def _replay(
        self, loss: torch.Tensor | None, records: list[tuple[str, Any, dict[str, Any]]], last: bool, parts: int
    ) -> Any:
        """Send the last stage's loss and logged values to every rank of the pipeline group, and log them there
        (each name once per batch: its ``parts`` micro-batches' values combined by the name's ``reduce_fx``, the mean
        by default, the sum for ``reduce_fx="sum"``; an explicit ``batch_size`` is multiplied by ``parts``)."""
        payload: list[Any] = [None]
        if last:
            merged: dict[str, tuple[list[Any], dict[str, Any]]] = {}
            for name, value, kwargs in records:
                merged.setdefault(name, ([], kwargs))[0].append(value)
            logged = [(name, _combine(values, kwargs.get("reduce_fx", "mean")), kwargs)
                      for name, (values, kwargs) in merged.items()]  # fmt: skip
            payload = [(None if loss is None else loss.cpu(), logged)]
        owner = torch.distributed.get_global_rank(self.group, (self.stages - 1) % self.degree)
        torch.distributed.broadcast_object_list(payload, src=owner, group=self.group)
        value, logged = payload[0]
        for name, mean, kwargs in logged:
            if isinstance(mean, torch.Tensor):
                mean = mean.to(self.device)
            if kwargs.get("batch_size") is not None:
                kwargs = {**kwargs, "batch_size": kwargs["batch_size"] * parts}
            self.module.log(name, mean, **kwargs)
        return None if value is None else value.to(self.device)

    # --- evaluation ---------------------------------------------------------------------------------------------
    def eval_step(self, name: str, batch: Any, rest: tuple[Any, ...]) -> Any:
        """One validation/test batch, whole, through the stages in order (forward only, blocking sends)."""
        fn = getattr(self.module, name)
        meta = self._meta(fn, batch, rest, name)
        records: list[tuple[str, Any, dict[str, Any]]] = []
        result: Any = None
        previous: torch.Tensor | None = None
        with self._recorded_log(records):
            for s in self.local:
                incoming = None
                if s > 0:
                    if (s - 1) % self.degree == self.rank and previous is not None:
                        incoming = previous
                    else:
                        incoming = torch.empty(meta[0], dtype=meta[1], device=self.device)
                        src = torch.distributed.get_global_rank(self.group, (s - 1) % self.degree)
                        torch.distributed.recv(incoming, src=src, group=self.group)
                run = StageRun(self.plan.blocks(s), incoming, s == self.stages - 1, meta=meta)
                self.blocks.run = run
                try:
                    result = fn(batch, *rest)
                except StageOutput as out:
                    previous = out.hidden
                    if (s + 1) % self.degree != self.rank:
                        dst = torch.distributed.get_global_rank(self.group, (s + 1) % self.degree)
                        torch.distributed.send(previous.contiguous(), dst=dst, group=self.group)
                finally:
                    self.blocks.run = None
        last = self.stages - 1 in self.local
        self._replay(None, records, last, 1)
        return result if last else None

    # --- gradients ---------------------------------------------------------------------------------------------
    def add_pending_grads(self) -> None:
        """Add the last training batch's gradients (computed by the schedule inside the step) to ``.grad``: called
        where Lightning runs the backward pass, after it has zeroed the gradients of a new accumulation window."""
        pending, self._pending = self._pending, []
        for p, grad in zip(self.owned + self.replicated, pending, strict=False):
            if grad is None:
                continue
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)

    def sync_replicated_grads(self) -> None:
        """Sum the gradients of the parameters every stage holds (embeddings, head, norms) over the pipeline group
        (each stage computed only its part of them), and average them over the data-parallel pipelines. A parameter
        without a gradient anywhere keeps none."""
        if not self.replicated:
            return
        has = torch.tensor([p.grad is not None for p in self.replicated], dtype=torch.int32, device=self.device)
        torch.distributed.all_reduce(has, op=torch.distributed.ReduceOp.MAX, group=self.group)
        params = [p for p, h in zip(self.replicated, has.tolist(), strict=True) if h]
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        locals_ = [local_view(g) for g in grads]  # a tensor-parallel gradient: this rank's part (alike on each stage)
        flat = torch.cat([g.reshape(-1) for g in locals_])
        torch.distributed.all_reduce(flat, group=self.group)
        self.reduced_bytes += 2 * (self.degree - 1) / self.degree * flat.numel() * flat.element_size()
        if self.data_group is not None:
            replicas = torch.distributed.get_world_size(self.data_group)
            torch.distributed.all_reduce(flat, group=self.data_group)
            flat /= replicas
            self.reduced_bytes += 2 * (replicas - 1) / replicas * flat.numel() * flat.element_size()
        offset = 0
        for p, grad, local in zip(params, grads, locals_, strict=True):
            n = local.numel()
            local.copy_(flat[offset : offset + n].view_as(local))
            p.grad = grad
            offset += n

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the 2-norm over every stage's gradients (each replicated gradient counted once: they are equal
        on every stage after :meth:`sync_replicated_grads`)."""
        owned = {id(p) for p in self.owned}
        pairs = [(p, p.grad) for p in parameters if p.grad is not None]
        own = grad_power_sum([g for p, g in pairs if id(p) in owned]).to(self.device)  # (summed over tensor parallel)
        torch.distributed.all_reduce(own, group=self.group)
        shared = grad_power_sum([g for p, g in pairs if id(p) not in owned]).to(self.device)
        total = (own + shared).sqrt()
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for _, g in pairs:
            local = local_view(g)
            local.detach().mul_(coefficient.to(local.dtype))
        return total

    def before_backward(self, stage: int) -> None:
        """ZeRO-1/2 across pipelines: whether this backward of ``stage``'s blocks reshards their parameters and (ZeRO-1)
        reduce-scatters their gradients over the data-parallel ranks: only the stage's last backward of the batch,
        outside accumulation (FSDP2's ``set_reshard_after_backward`` / ``set_requires_gradient_sync``)."""
        if not self.keep_gathered:
            return
        from torch.distributed.fsdp import FSDPModule

        self._backwards[stage] += 1
        last = self.sync_allowed and self._backwards[stage] == self.microbatches
        for name in self.plan.blocks(stage):
            block = self.blocks.get_submodule(name)
            if isinstance(block, FSDPModule):
                block.set_reshard_after_backward(last, recurse=False)
                if self.defer_sync:
                    block.set_requires_gradient_sync(last, recurse=False)

    # --- the bubble --------------------------------------------------------------------------------------------
    def _record(self, stage: int, kind: str, mb: int, seconds: float) -> None:
        self.actions.append((stage, kind, mb, seconds))

    def bubble(self, steady: bool = False) -> float:
        """The last training batch's bubble: :func:`simulated_bubble` over every rank's measured action times
        (``steady``: each stage's median time per kind of action). A collective over the pipeline group (the
        times are gathered here, not at every step): call it on every rank, e.g. from a callback hook."""
        gathered: list[Any] = [None] * self.degree
        torch.distributed.all_gather_object(gathered, self.actions, group=self.group)
        timings = dict(enumerate(gathered))
        if not any(timings.values()):
            return math.nan
        return simulated_bubble(timings, self.stages, steady)


def _combine(values: list[Any], reduce_fx: Any) -> Any:
    """One batch's value from its micro-batches' values of one logged name, as Lightning combines a name's values
    over the batches of an epoch (``reduce_fx``: "mean", "sum", "max", "min", or torch's function of one
    tensor)."""
    name = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        values = [torch.tensor(float(v)) for v in values]
        plain = True
    elif all(isinstance(v, torch.Tensor) for v in values):
        plain = False
    else:
        return values[-1]
    stacked = torch.stack([v.detach().float().cpu() for v in values])
    if name in ("sum", "max", "min", "mean"):
        out = getattr(stacked, name)(dim=0)
        out = out.values if name in ("max", "min") else out
    elif callable(reduce_fx):
        out = reduce_fx(stacked)
    else:
        out = stacked.mean(dim=0)
    return float(out) if plain else out


def _time_actions(stage: Any, runner: PipelineRunner) -> None:
    """Time ``stage``'s forward and backward of each micro-batch (per-action compute, for the bubble), and count the
    bytes of the messages it sends to other stages."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def timed_forward(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = forward(fwd_chunk_id, *args, **kwargs)
        runner._record(stage.stage_index, "F", fwd_chunk_id, time.perf_counter() - start)
        return out

    def timed_backward(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        runner.before_backward(stage.stage_index)
        start = time.perf_counter()
        out = backward(bwd_chunk_id, *args, **kwargs)
        runner._record(stage.stage_index, "B", bwd_chunk_id, time.perf_counter() - start)
        return out

    def counted(get_ops: Any) -> Any:
        def ops(chunk_id: int) -> Any:
            found = get_ops(chunk_id)
            runner.sent_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in found)
            return found

        return ops

    stage.forward_one_chunk = timed_forward
    stage.backward_one_chunk = timed_backward
    stage.get_fwd_send_ops = counted(stage.get_fwd_send_ops)
    stage.get_bwd_send_ops = counted(stage.get_bwd_send_ops)
