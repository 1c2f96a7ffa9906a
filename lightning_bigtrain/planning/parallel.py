"""Planner rows for tensor parallelism under ZeRO-3: ``zero3_tp{T}`` (``ZeroStrategy(stage=3, tensor_parallel=T)``).

The split is :func:`~lightning_bigtrain.functional.tensor_parallel.plan_tensor_parallel`'s, found from the model's
structure as the strategy finds it (the strategy also checks each block class on a copy and keeps a class whole if
its split copy disagrees: the planner cannot run that check and assumes it passes). Per rank:

* **Model states**, exact: each parameter's local shape after the split (its split dimension divided by ``T``),
  then FSDP2's shard over the ``N / T`` data-parallel ranks (dimension 0 padded to a multiple of ``N / T``).
* **Tensor-parallel bytes**, from the messages' sizes measured on fake tensors (a forward of the unsplit model with
  hooks on the split modules): each row split's output is all-reduced in forward and each column split's input
  gradient in backward (DTensor redistributes the partial sums); the vocabulary-split embedding's output is
  all-reduced, the LM head's logits all-gathered and its input gradient all-reduced. Ring equivalent: an
  all-reduce sends ``2(T-1)/T`` of the message, an all-gather ``(T-1)/T`` of its output. The tensor-parallel group
  is taken within a node (intra-node bandwidth).
* **Data-parallel bytes**: ZeRO-3's (two all-gathers and a reduce-scatter per step) of the local shapes, over
  ``N / T`` ranks.
* **Activations**: measured on fake tensors as for the other rows, with what is saved inside a split region (from a
  column split's output to the end of the row split that closes it: attention's heads, the MLP's hidden activation,
  the row split's input) divided by ``T``; the rest (block inputs, norms, residuals, logits) is whole on every rank
  (sequence parallelism is not implemented). With activation checkpointing, the unsplit model's (an upper bound).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

from lightning_bigtrain.functional.tensor_parallel import Split, TensorParallelPlan, plan_tensor_parallel

__all__ = ["PipelineEstimate", "TensorParallelEstimate", "estimate_pipeline", "estimate_tensor_parallel", "layouts"]


def layouts(devices: int) -> list[int]:
    """The tensor-parallel degrees the planner tries on nodes of ``devices``: every divisor from 2 up."""
    return [d for d in range(2, devices + 1) if devices % d == 0]


def _split_dims(model: nn.Module, plan: TensorParallelPlan) -> dict[int, int]:
    """``id(parameter)`` -> the dimension the split divides (absent: whole on every rank)."""
    dims: dict[int, int] = {}

    def weight_dim(split: Split) -> int | None:
        if split.style in ("column", "vocab_head"):
            return 1 if split.conv1d else 0
        if split.style == "row":
            return 0 if split.conv1d else 1
        if split.style == "head_embedding":
            return 1  # one column per head
        return 0  # vocab_embedding: rows

    for name, split in plan.splits.items():
        module = model.get_submodule(name)
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        d = weight_dim(split)
        if isinstance(weight, torch.Tensor) and d is not None:
            dims[id(weight)] = d
        if isinstance(bias, torch.Tensor) and split.style != "row":
            dims[id(bias)] = 0
    return dims


@torch.no_grad()
def _messages(
    model: nn.Module, plan: TensorParallelPlan, example: torch.Tensor, sequence: TensorParallelPlan | None = None
) -> list[tuple[str, int]]:
    """``("all_reduce" | "all_gather" | "reduce_scatter", elements)`` for each tensor-parallel collective of one
    forward and backward, measured on fake tensors (elements: of the whole tensor). With ``sequence`` (the plan with
    sequence parallelism turned on), the split blocks' collectives as sequence parallelism issues them: a column split
    gathers its input in forward and reduce-scatters its gradient in backward, a row split reduce-scatters its output
    and gathers its gradient; each container of blocks gathers the activation where it leaves and its gradient where
    it enters; the blocks' norms all-reduce their parameters' gradients (partial over the split sequence)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    found: list[tuple[str, int]] = []
    hooks = []

    def numel(x: Any) -> int:
        x = x if isinstance(x, torch.Tensor) else x[0]
        return int(x.numel())

    blocks = tuple(f"{b}." for b in sequence.blocks) if sequence is not None else ()
    for name, split in plan.splits.items():
        module = model.get_submodule(name)
        in_block = bool(blocks) and name.startswith(blocks)

        def hook(
            m: nn.Module, args: tuple[Any, ...], out: Any, split: Split = split, in_block: bool = in_block
        ) -> None:
            if in_block and split.style == "row":
                found.extend([("reduce_scatter", numel(out)), ("all_gather", numel(out))])
            elif in_block and split.style == "column":
                found.extend([("all_gather", numel(args)), ("reduce_scatter", numel(args))])
            elif split.style == "row":
                found.append(("all_reduce", numel(out)))  # forward: partial sums
            elif split.style == "column":
                found.append(("all_reduce", numel(args)))  # backward: the input's gradient
            elif split.style == "vocab_embedding":
                found.append(("all_reduce", numel(out)))
            elif split.style == "head_embedding":
                pass  # each rank looks up its own heads' columns: no collective
            else:  # vocab_head: logits gathered, the input's gradient all-reduced in backward
                found.extend([("all_gather", numel(out)), ("all_reduce", numel(args))])

        hooks.append(module.register_forward_hook(hook))
    if sequence is not None:
        containers: dict[str, list[str]] = {}
        for name in sequence.blocks:
            containers.setdefault(name.rpartition(".")[0], []).append(name)
        for run in containers.values():
            hooks.append(model.get_submodule(run[0]).register_forward_hook(
                lambda m, args, out: found.append(("all_gather", numel(args)))))  # its gradient, entering  # fmt: skip
            hooks.append(model.get_submodule(run[-1]).register_forward_hook(
                lambda m, args, out: found.append(("all_gather", numel(out)))))  # the activation, leaving  # fmt: skip
        for norm in sequence.norms:
            found.extend(("all_reduce", p.numel()) for p in model.get_submodule(norm).parameters() if p.requires_grad)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            params = {n: mode.from_tensor(p) for n, p in model.named_parameters()}
            buffers = {n: mode.from_tensor(b) for n, b in model.named_buffers()}
            torch.func.functional_call(model, {**params, **buffers}, (mode.from_tensor(example),))
    finally:
        for h in hooks:
            h.remove()
    return found


class TensorParallelEstimate:
    """Per-rank model-state elements and tensor-parallel messages of one degree (see the module docstring)."""

    def __init__(self, model: nn.Module, degree: int, world: int, example: torch.Tensor | None) -> None:
        if world % degree:
            raise ValueError(f"tensor_parallel={degree} does not divide the world size {world}")
        self.degree, self.data_parallel = degree, world // degree
        subject = model
        if any(type(m) is nn.MultiheadAttention for m in model.modules()):
            # The strategy holds blocks' nn.MultiheadAttention as HeadedAttention (split by heads): plan that.
            from lightning_bigtrain.functional.attention import swap_multihead_attention_
            from lightning_bigtrain.functional.tensor_parallel import _blocks

            subject = copy.deepcopy(model)
            inside = tuple(f"{name}." for name, _ in _blocks(subject))
            names = [n for n, m in subject.named_modules() if type(m) is nn.MultiheadAttention and n.startswith(inside)]
            swap_multihead_attention_(subject, names)
        self.plan = plan_tensor_parallel(subject, degree)
        dims = _split_dims(subject, self.plan)
        self.local_numel = 0  # after the split, before FSDP2
        self.shard_numel = 0  # FSDP2's shard over the data-parallel ranks (padded)
        self.shard_numel_trainable = 0
        self.tensors = 0
        for p in subject.parameters():
            shape = list(p.shape) or [1]
            if id(p) in dims:
                shape[dims[id(p)]] //= degree
            rows, rest = shape[0], math.prod(shape[1:])
            self.local_numel += rows * rest
            shard = math.ceil(rows / self.data_parallel) * rest if self.data_parallel > 1 else rows * rest
            self.shard_numel += shard
            if p.requires_grad:
                self.shard_numel_trainable += shard
                self.tensors += 1
        self.messages = _messages(subject, self.plan, example) if example is not None else []
        self.subject = subject
        # Sequence parallelism, as the strategy would decide it from the structure (its numerical check on a copy of
        # each block class runs only in a real run): why not, or the messages it would send.
        from lightning_bigtrain.functional.tensor_parallel import _plan_sequence

        sequence = copy.copy(self.plan)
        _plan_sequence(subject, sequence, None, verify=False)
        self.sequence_refused: str | None = sequence.sequence_refused if sequence.sequence_dim is None else None
        self.sequence_messages: list[tuple[str, int]] = []
        if self.sequence_refused is None and example is not None:
            self.sequence_messages = _messages(subject, self.plan, example, sequence)

    def activations(
        self, example: torch.Tensor, precision: str = "32-true", sequence_parallel: bool = False
    ) -> tuple[float, float, float]:
        """Per-rank saved activations, as :func:`~lightning_bigtrain.planning.planner.measure_activations` measures
        them, with what is saved inside the split regions (a column split's output to its row split's end) divided
        by the degree, and with ``sequence_parallel`` what the split blocks save outside them too (but the column
        splits' gathered inputs): ``(plain, checkpointed, working set)``."""
        from lightning_bigtrain.planning.planner import measure_activations

        columns = [self.subject.get_submodule(n) for n, s in self.plan.splits.items() if s.style == "column"]
        rows = [self.subject.get_submodule(n) for n, s in self.plan.splits.items() if s.style == "row"]
        blocks = [self.subject.get_submodule(n) for n in self.plan.blocks if n not in self.plan.replicated]
        return measure_activations(self.subject, example, precision=precision, split=(columns, rows, self.degree),
                                   sequence_blocks=blocks if sequence_parallel else ())  # fmt: skip

    def tensor_parallel_bytes(self, element_bytes: int, sequence_parallel: bool = False) -> float:
        """Bytes one rank sends per step in the tensor-parallel collectives (ring equivalent)."""
        t = self.degree
        factor = {"all_reduce": 2 * (t - 1) / t, "all_gather": (t - 1) / t, "reduce_scatter": (t - 1) / t}
        messages = self.sequence_messages if sequence_parallel else self.messages
        return sum(factor[kind] * n * element_bytes for kind, n in messages)

    def tensor_parallel_seconds(
        self, element_bytes: int, bandwidth: float, latency: float, sequence_parallel: bool = False
    ) -> float:
        t = self.degree
        steps = {"all_reduce": 2 * (t - 1), "all_gather": t - 1, "reduce_scatter": t - 1}
        messages = self.sequence_messages if sequence_parallel else self.messages
        return (
            sum(steps[kind] * latency for kind, _ in messages)
            + self.tensor_parallel_bytes(element_bytes, sequence_parallel) / bandwidth
        )


def estimate_tensor_parallel(
    model: nn.Module, degree: int, world: int, example: torch.Tensor | None = None
) -> TensorParallelEstimate:
    """:class:`TensorParallelEstimate` of ``model`` split ``degree`` ways on ``world`` ranks; ``example`` (a batch
    of one device) measures the tensor-parallel messages."""
    return TensorParallelEstimate(model, degree, world, example)


class PipelineEstimate:
    """Per-rank model states, activations, messages and bubble of ``ZeroStrategy(pipeline_parallel=P)``.

    The cut is :func:`~lightning_bigtrain.functional.pipeline.plan_pipeline`'s (as the strategy cuts). Per rank:

    * **Model states**, exact: the blocks of this rank's stages, plus everything outside the block container
      (embeddings, head, norms: every stage holds them); with ``world / P`` pipelines, each block is a ZeRO-3 unit
      across them (FSDP2's shard: dimension 0 padded to a multiple of the replicas).
    * **Pipeline bytes**, exact: each micro-batch's activation is sent to the next stage in forward and its gradient
      to the previous one in backward, both of the blocks' input's shape and dtype (measured on fake tensors at the
      micro-batch size); and once per step the gradients of what every stage holds are summed over the pipeline
      group (an all-reduce). Across pipelines, each block is gathered twice and its gradient reduce-scattered per
      micro-batch, and what every stage holds is averaged (an all-reduce).
    * **Activations**: measured on fake tensors at the micro-batch size, cut where the blocks begin and end: a
      stage saves the part before the blocks (every stage runs it), its own blocks' and, on the last stage, the part
      after; times the micro-batches in flight (GPipe: all ``m``; 1F1B on rank ``r``: ``min(p - r, m)``; the
      interleaved schedule's are not estimated).
    * **Bubble**: :func:`~lightning_bigtrain.functional.pipeline.bubble_fraction` of the schedule.
    """

    def __init__(
        self,
        model: nn.Module,
        degree: int,
        world: int,
        example: torch.Tensor | None,
        *,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        stages_per_rank: int = 1,
        precision: str = "32-true",
    ) -> None:
        from lightning_bigtrain.functional.pipeline import bubble_fraction, plan_pipeline

        if world % degree:
            raise ValueError(f"pipeline_parallel={degree} does not divide the world size {world}")
        self.degree, self.schedule = degree, schedule
        self.data_parallel = dp = world // degree
        self.microbatches = microbatches if microbatches is not None else 2 * degree
        self.virtual = stages_per_rank if schedule == "interleaved_1f1b" else 1
        self.plan = plan_pipeline(model, degree * self.virtual)
        container = model.get_submodule(self.plan.container)
        blocks = dict(container.named_children())
        inside = {id(p) for p in container.parameters()}
        outside = [p for p in model.parameters() if id(p) not in inside]
        self.local_stages = [[s for s in range(self.plan.stages) if s % degree == r] for r in range(degree)]
        self.outside_trainable = sum(p.numel() for p in outside if p.requires_grad)
        self.numel: list[int] = []
        self.numel_trainable: list[int] = []
        self.tensors: list[int] = []
        self.unit_numel: list[int] = []  # the rank's blocks gathered whole (padded), per micro-batch's all-gather
        self.largest_unit: list[int] = []  # the rank's largest block (gathered whole while it computes)

        def shard(p: torch.Tensor) -> int:  # FSDP2: dimension 0 padded to a multiple of the replicas
            shape = list(p.shape) or [1]
            return math.ceil(shape[0] / dp) * math.prod(shape[1:]) if dp > 1 else p.numel()

        for stages in self.local_stages:
            inner = [p for s in stages for n in self.plan.blocks(s) for p in blocks[n].parameters()]
            self.numel.append(sum(p.numel() for p in outside) + sum(shard(p) for p in inner))
            self.numel_trainable.append(sum(p.numel() for p in outside if p.requires_grad)
                                        + sum(shard(p) for p in inner if p.requires_grad))  # fmt: skip
            self.tensors.append(sum(1 for p in [*outside, *inner] if p.requires_grad))
            self.unit_numel.append(sum(shard(p) * dp for p in inner))
            self.largest_unit.append(max(sum(p.numel() for p in blocks[n].parameters())
                                         for s in stages for n in self.plan.blocks(s)))  # fmt: skip
        self.bubble = bubble_fraction(schedule, degree, self.microbatches, self.virtual)  # type: ignore[arg-type]
        self.hidden_bytes = 0
        self.breakdown: dict[str, Any] = {}
        if example is not None:
            if example.shape[0] % self.microbatches:
                raise ValueError(f"a batch of {example.shape[0]} cannot be cut into {self.microbatches} micro-batches")
            self._measure(model, list(blocks.values()), example[: example.shape[0] // self.microbatches], precision)

    def _measure(self, model: nn.Module, blocks: list[nn.Module], micro: torch.Tensor, precision: str) -> None:
        from lightning_bigtrain.planning.planner import measure_activations

        measure_activations(model, micro, checkpoint_blocks=blocks, precision=precision, breakdown=self.breakdown)
        self.hidden_bytes = int(self.breakdown["hidden"])

    def pipeline_bytes(self, rank: int) -> float:
        """Bytes ``rank`` sends per step: an activation forward from each stage but the last, a gradient back from
        each but the first, per micro-batch."""
        last = self.plan.stages - 1
        messages = sum((s < last) + (s > 0) for s in self.local_stages[rank])
        return float(messages * self.microbatches * self.hidden_bytes)

    def reduce_bytes(self, element_bytes: int) -> float:
        """Bytes each rank sends per step summing the gradients of what every stage holds (embeddings, head, norms)
        over the pipeline group, then averaging them over the pipelines: all-reduces, ring equivalent ``2(k-1)/k`` of
        the message over ``k`` ranks."""
        p, d = self.degree, self.data_parallel
        return (2 * (p - 1) / p + 2 * (d - 1) / d) * self.outside_trainable * element_bytes

    def sharding_bytes(self, rank: int, param_bytes: int, grad_bytes: int, stage: int = 3) -> float:
        """Bytes ``rank`` sends per step sharding its blocks across the pipelines (FSDP2; ring equivalent
        ``(d-1)/d`` of what is gathered or reduce-scattered). ZeRO-3: per micro-batch, its blocks gathered for forward
        and again for backward, and their gradients reduce-scattered. ZeRO-2: gathered once and kept through the
        step, the gradients reduce-scattered after each micro-batch's backward. ZeRO-1: gathered once, the whole
        gradients accumulated over the micro-batches and reduce-scattered once."""
        d = self.data_parallel
        if d == 1:
            return 0.0
        m = self.microbatches
        per_element = {3: m * (2 * param_bytes + grad_bytes), 2: param_bytes + m * grad_bytes,
                       1: param_bytes + grad_bytes}[stage]  # fmt: skip
        return (d - 1) / d * self.unit_numel[rank] * per_element

    def in_flight(self, rank: int) -> int | None:
        """Micro-batches whose activations ``rank`` holds at once (None: the interleaved schedule, not estimated)."""
        if self.schedule == "gpipe":
            return self.microbatches
        if self.schedule == "1f1b":
            return min(self.degree - rank, self.microbatches)
        return None

    def activations(self, rank: int) -> float | None:
        """Bytes ``rank`` holds saved for backward at its peak (None without an example or for interleaving)."""
        count = self.in_flight(rank)
        if not self.breakdown or count is None:
            return None
        names = self.plan.names
        per_block = dict(zip(names, self.breakdown["blocks"], strict=True))
        local = sum(per_block[n] for s in self.local_stages[rank] for n in self.plan.blocks(s))
        last = self.plan.stages - 1 in self.local_stages[rank]
        return count * (self.breakdown["before"] + local + (self.breakdown["after"] if last else 0.0))


def estimate_pipeline(model: nn.Module, degree: int, world: int, example: torch.Tensor | None = None,
                      **kwargs: Any) -> PipelineEstimate:  # fmt: skip
    """:class:`PipelineEstimate` of ``model`` cut into ``degree`` pipeline ranks of ``world``; ``example`` (a batch of
    one pipeline) measures the messages and activations."""
    return PipelineEstimate(model, degree, world, example, **kwargs)
