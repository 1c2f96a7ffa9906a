"""Pipeline parallelism for any module: its repeated blocks split into stages, the rest of its step on every stage.

A model's step is Python code the user wrote: an embedding, a loop over blocks, a head, a loss. Cutting that code
into stage functions would need tracing, which Hugging Face models, masks and data-dependent control flow resist.
Instead, the block container (the ``ModuleList`` / ``Sequential`` of repeated blocks) is replaced by
:class:`PipelinedBlocks`, which holds only this rank's blocks, and every stage runs the *whole* step:

* stage 0: the code before the blocks (embeddings, masks) gives the container its input; the stage's blocks run on
  it and :class:`StageOutput` carries the result out of the step (the code after the blocks is not run);
* a middle stage: the code before the blocks runs too (so that masks and other arguments of the blocks exist
  here), but its blocks run on the activation received from the previous stage, and the result leaves by
  :class:`StageOutput`;
* the last stage: as a middle one, and then the step goes on: the head and the loss, as the user wrote them.

What is outside the container is therefore replicated on every stage; its gradients are partial on each (the
embedding's on stage 0, the head's on the last, a tied weight's on both) and summed over the pipeline group
before the optimizer step. A block is called with its first positional argument as the hidden state, and must
return it (or a tuple starting with it) with the same shape and dtype.

The schedules are ``torch.distributed.pipelining``'s (GPipe: Huang et al., 2019; 1F1B: Narayanan et al., 2019,
"PipeDream"; interleaved 1F1B: Narayanan et al., 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM"); :func:`bubble_fraction` is their idle fraction from those papers, and
:func:`simulated_bubble` replays measured per-action times through the same dependencies.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

__all__ = [
    "PipelinePlan",
    "PipelinedBlocks",
    "StageInput",
    "StageOutput",
    "StageRun",
    "bubble_fraction",
    "install_pipeline_",
    "plan_pipeline",
    "simulated_bubble",
]

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
_CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass(frozen=True)
class PipelinePlan:
    """Where a model is cut: the block container and the first block of each stage.

    Attributes:
        container: Dotted name of the container of repeated blocks (``"blocks"``, ``"transformer.h"``).
        names: Its children's names, in order.
        boundaries: Stage ``s`` holds ``names[boundaries[s]:boundaries[s + 1]]``; ``len == stages + 1``.
        costs: Each block's parameter count (what the automatic split balances).
        others: Other containers of repeated blocks, left whole on every stage (named in a warning).
    """

    container: str
    names: tuple[str, ...]
    boundaries: tuple[int, ...]
    costs: tuple[int, ...]
    others: tuple[str, ...] = ()

    @property
    def stages(self) -> int:
        return len(self.boundaries) - 1

    def blocks(self, stage: int) -> tuple[str, ...]:
        """The names of stage ``stage``'s blocks."""
        return self.names[self.boundaries[stage] : self.boundaries[stage + 1]]


def _containers(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """Containers whose children are two or more blocks of one class holding parameters: (name, container,
    parameter count), outermost first (a container inside a block is the block's own)."""
    found: list[tuple[str, nn.Module, int]] = []
    for name, module in model.named_modules():
        if not isinstance(module, _CONTAINERS) or any(name.startswith(f"{n}.") for n, _, _ in found):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        if not any(p.requires_grad for p in module.parameters()):
            continue
        found.append((name, module, sum(p.numel() for p in module.parameters())))
    return found


def _balanced(costs: Sequence[int], stages: int) -> tuple[int, ...]:
    """Contiguous cut of ``costs`` into ``stages`` non-empty groups minimizing the largest group's sum (exact:
    dynamic programming over prefix sums; block counts are small)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible largest sum cutting the first i blocks into k groups; cut[k][i] its last cut.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return tuple(reversed(bounds))


def plan_pipeline(model: nn.Module, stages: int, split_points: Sequence[int] | None = None) -> PipelinePlan:
    """Cut ``model`` into ``stages`` pipeline stages along its largest container of repeated blocks.

    Args:
        model: Any module with a ``ModuleList`` / ``Sequential`` of two or more blocks of one class.
        stages: The number of stages (pipeline degree x stages per rank).
        split_points: The index of the first block of stages 1, 2, ... (``stages - 1`` increasing indices);
            ``None`` balances the blocks' parameter counts.

    Raises:
        ValueError: No such container, fewer blocks than stages, or bad ``split_points``.
    """
    found = _containers(model)
    if not found:
        raise ValueError(
            f"pipeline_parallel={stages}: {type(model).__name__} has no ModuleList/Sequential of two or more blocks "
            "of one class (transformer layers) to cut into stages."
        )
    name, container, _ = max(found, key=lambda entry: entry[2])
    names = tuple(n for n, _ in container.named_children())
    costs = tuple(sum(p.numel() for p in block.parameters()) for block in container.children())
    if len(names) < stages:
        raise ValueError(
            f"pipeline_parallel: {len(names)} blocks in `{name}` cannot fill {stages} stages (each needs one). "
            "Lower pipeline_parallel (or stages_per_rank)."
        )
    if split_points is None:
        bounds = _balanced(costs, stages)
    else:
        points = list(split_points)
        if len(points) != stages - 1 or any(not isinstance(p, int) for p in points):
            raise ValueError(
                f"PipelineOptions(split_points={points}): give {stages - 1} block indices (the first block of "
                f"stages 1..{stages - 1}) for {stages} stages."
            )
        bounds = (0, *points, len(names))
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise ValueError(
                f"PipelineOptions(split_points={points}): must increase strictly within 1..{len(names) - 1} "
                f"(`{name}` has {len(names)} blocks), so that every stage holds at least one block."
            )
    others = tuple(n for n, _, _ in found if n != name and not n.startswith(f"{name}."))
    return PipelinePlan(name, names, tuple(bounds), costs, others)


class StageOutput(BaseException):
    """Raised by :class:`PipelinedBlocks` to carry a non-last stage's result out of the user's step (a
    ``BaseException``, as ``KeyboardInterrupt``: a step's own ``except Exception`` must not stop it)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage output")
        self.hidden = hidden


class StageInput(BaseException):
    """Raised by :class:`PipelinedBlocks` in a probe: the blocks' input, to learn its shape and dtype."""

    def __init__(self, hidden: torch.Tensor, rest: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> None:
        super().__init__("pipeline stage input")
        self.hidden = hidden
        self.rest = rest  # the call's other arguments, for a probe of the blocks themselves
        self.kwargs = kwargs or {}


@dataclass
class StageRun:
    """What :class:`PipelinedBlocks` does when the step calls it.

    Attributes:
        names: The blocks to run (this stage's).
        incoming: The activation received from the previous stage (None on stage 0: the step's own input).
        last: Whether this is the last stage (return the result to the step instead of raising StageOutput).
        probe: Raise :class:`StageInput` with the blocks' input instead of running anything.
        meta: Shape and dtype every stage's input and output must have (checked), once known.
    """

    names: tuple[str, ...] = ()
    incoming: torch.Tensor | None = None
    last: bool = False
    probe: bool = False
    meta: tuple[torch.Size, torch.dtype] | None = None
    calls: int = field(default=0)


class _BlockView:
    """``container[i]`` for code that reads a block's attributes (``nn.TransformerEncoder`` reads ``layers[0]``'s
    configuration): answered from a local block of the same class; calling it is refused, since block ``i`` may
    live on another stage."""

    def __init__(self, owner: PipelinedBlocks, index: Any) -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_index", index)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._owner._template, name)

    def _refuse(self) -> RuntimeError:
        return RuntimeError(
            f"`{self._owner.container}[{self._index!r}]`: under pipeline parallelism the blocks of "
            f"`{self._owner.container}` are spread over the stages, so the step must run all of them by iterating the "
            f"container (`for block in {self._owner.container}: ...`) or calling it (`{self._owner.container}(x)`)."
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self._refuse()

    def __iter__(self) -> Iterator[Any]:
        raise self._refuse()


class PipelinedBlocks(nn.Module):
    """Stands in for a block container: holds this rank's blocks (under their own names, so that parameter
    names and checkpoints are the model's), and runs the current stage's blocks when the step reaches it.

    Iterating it yields one entry (itself: "the stage's blocks"), calling it runs them; ``len()`` is the whole
    container's; indexing gives a read-only view (see :class:`_BlockView`).
    """

    def __init__(self, container: str, names: Sequence[str], owned: dict[str, nn.Module]) -> None:
        super().__init__()
        if not owned:
            raise ValueError(f"PipelinedBlocks({container!r}): this rank holds no block.")
        for name, block in owned.items():
            self.add_module(name, block)
        self.container = container
        self._names = tuple(names)
        self.run: StageRun | None = None

    @property
    def _template(self) -> nn.Module:
        return next(iter(self._modules.values()))  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[nn.Module]:
        yield self

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice) and range(len(self._names))[index] == range(len(self._names)):
            return self  # every block (Hugging Face's Llama iterates `layers[:num_hidden_layers]`)
        return _BlockView(self, index)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the current stage's blocks (see :class:`StageRun`). A block is called with the hidden state first,
        then the step's other arguments, and must return the hidden state (or a tuple of it and non-tensors)."""
        run = self.run
        if run is None:
            raise RuntimeError(
                f"`{self.container}` is split into pipeline stages: it runs inside the strategy's training, "
                "validation and test steps only (for another use, consolidate the checkpoint and load the whole "
                "model: `bigtrain consolidate`)."
            )
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(
                f"`{self.container}`'s blocks must take the hidden state as their first positional argument "
                f"(pipeline parallelism passes it between stages); got {type(args[0]).__name__ if args else 'none'}."
            )
        run.calls += 1
        if run.calls > 1:
            raise RuntimeError(
                f"`{self.container}` was called twice in one step: pipeline parallelism runs each stage's blocks "
                "once per micro-batch (a step that runs the blocks twice cannot be pipelined)."
            )
        hidden, rest = args[0], args[1:]
        if run.probe:
            raise StageInput(hidden, rest, kwargs)
        x = hidden if run.incoming is None else run.incoming
        out = self._run_blocks(run.names, x, rest, kwargs, run.meta)
        if not run.last:
            raise StageOutput(out[0] if isinstance(out, (tuple, list)) else out)
        return out

    def _run_blocks(
        self, names: Sequence[str], x: torch.Tensor, rest: tuple[Any, ...], kwargs: dict[str, Any],
        meta: tuple[torch.Size, torch.dtype] | None,
    ) -> Any:  # fmt: skip
        """Run the blocks ``names`` in order from ``x``; each must return the hidden state (or a tuple of it and
        non-tensors) of ``meta``'s shape and dtype. Refusals are ValueError/TypeError naming the reason."""
        out: Any = x
        for name in names:
            out = self._modules[name](x, *rest, **kwargs)  # type: ignore[misc]
            x = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(out, (tuple, list)) and any(isinstance(o, torch.Tensor) for o in out[1:]):
                raise ValueError(
                    f"pipeline_parallel: `{self.container}`'s blocks return {len(out)} values with tensors beyond the "
                    "hidden state (e.g. T5's position bias, or key/value caches with use_cache=True); the step may "
                    "give them to the next block, but the stages pass only the hidden state. Switch the extra outputs "
                    "off (use_cache=False), or use tensor_parallel / ZeRO for this model."
                )
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"`{self.container}`'s blocks must return a tensor (or a tuple starting with one).")
            if meta is not None and (x.shape, x.dtype) != meta:
                raise ValueError(
                    f"pipeline_parallel: `{self.container}`'s blocks changed the hidden state from {tuple(meta[0])} "
                    f"{meta[1]} to {tuple(x.shape)} {x.dtype} (block `{name}`); the stages pass one shape and dtype "
                    "between them, so a model whose blocks change the shape (a CNN's stages) cannot be cut there. "
                    "Use ZeRO (`ZeroStrategy(stage=...)` without pipeline_parallel) for this model."
                )
        return out

    def check_stages(self, stages: Sequence[Sequence[str]], found: StageInput) -> str | None:
        """Run each of this rank's stages on the blocks' input ``found`` (a probe's, no gradients) and return why
        the model cannot be pipelined, or None. Every stage's input has the first one's shape and dtype when the
        blocks keep it, so each stage is checked from it: a refusal comes before the schedule, on the rank whose
        blocks cause it."""
        meta = (found.hidden.shape, found.hidden.dtype)
        # In eval mode: a probe must not move running statistics (a resumed run probes again, the uninterrupted one
        # does not).
        modes = {m: m.training for m in self.modules()}
        self.eval()
        try:
            for names in stages:
                try:
                    self._run_blocks(names, found.hidden, found.rest, found.kwargs, meta)
                except (ValueError, TypeError) as error:
                    if str(error).startswith(("pipeline_parallel", f"`{self.container}`")):
                        return str(error)
                    return self._cannot_run(names, meta, error)
                except Exception as error:  # e.g. a convolution that expects another stage's channels
                    return self._cannot_run(names, meta, error)
        finally:
            for m, training in modes.items():
                m.training = training
        return None

    def _cannot_run(self, names: Sequence[str], meta: tuple[torch.Size, torch.dtype], error: Exception) -> str:
        return (
            f"pipeline_parallel: `{self.container}`'s blocks {', '.join(f'`{n}`' for n in names)} cannot run on the "
            f"hidden state the first block takes ({tuple(meta[0])} {meta[1]}): {type(error).__name__}: "
            f"{str(error)[:200]}. The stages pass one shape and dtype between them, so every block must take and "
            "return it; a model whose blocks change the shape (a CNN's stages) cannot be cut there. Use ZeRO "
            "(`ZeroStrategy(stage=...)` without pipeline_parallel) for this model."
        )


def install_pipeline_(model: nn.Module, plan: PipelinePlan, stages: Sequence[int]) -> PipelinedBlocks:
    """Replace ``plan.container`` in ``model`` by a :class:`PipelinedBlocks` holding the blocks of ``stages``
    (this rank's); the other blocks are dropped (their memory freed once nothing else refers to them)."""
    parent_name, _, attr = plan.container.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    container = getattr(parent, attr)
    keep = {name for s in stages for name in plan.blocks(s)}
    owned = {name: block for name, block in container.named_children() if name in keep}
    stub = PipelinedBlocks(plan.container, plan.names, owned)
    setattr(parent, attr, stub)
    return stub


def bubble_fraction(schedule: Schedule, stages: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The idle fraction of a pipeline of ``stages`` ranks (each rank's time, forward and backward alike, per
    micro-batch equal): ``(p - 1) / (v * m + p - 1)`` for ``m`` micro-batches and ``v`` stages per rank (GPipe and
    1F1B: ``v = 1``; Narayanan et al., 2021, section 2.2: the bubble is ``(p - 1) / (v m)`` of the ideal time)."""
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return (stages - 1) / (v * microbatches + stages - 1)


def simulated_bubble(actions: dict[int, list[tuple[int, str, int, float]]], stages: int, steady: bool = False) -> float:
    """The idle fraction of a pipeline whose ranks ran ``actions`` in order, each taking its measured time.

    ``actions[rank]`` lists ``(stage, kind, microbatch, seconds)`` with ``kind`` ``"F"`` or ``"B"``. An action
    starts once its rank is free and what it needs is done: ``F`` of stage ``s`` needs ``F`` of stage ``s - 1``
    (same micro-batch); ``B`` needs ``B`` of stage ``s + 1`` (the last stage's ``B`` needs its own ``F``). The
    result is ``1 - busy / (ranks x makespan)``: the schedule's bubble at the measured action times, free of the
    host's scheduling noise (on oversubscribed CPU cores the wall clock measures the OS, not the pipeline).

    ``steady``: each action takes the median time of its stage's actions of its kind instead of its own (on shared
    CPU cores an action that runs while the other ranks idle gets their cores too, and shrinks the bubble it is in).
    """
    if steady:
        import statistics

        times: dict[tuple[int, str], list[float]] = {}
        for acts in actions.values():
            for stage, kind, _, seconds in acts:
                times.setdefault((stage, kind), []).append(seconds)
        median = {key: statistics.median(values) for key, values in times.items()}
        actions = {r: [(s, k, m, median[(s, k)]) for s, k, m, _ in acts] for r, acts in actions.items()}
    done: dict[tuple[int, str, int], float] = {}
    free = dict.fromkeys(actions, 0.0)
    position = dict.fromkeys(actions, 0)
    busy = sum(t for acts in actions.values() for *_, t in acts)
    remaining = sum(len(a) for a in actions.values())
    while remaining:
        progressed = False
        for rank, acts in actions.items():
            while position[rank] < len(acts):
                stage, kind, mb, seconds = acts[position[rank]]
                if kind == "F":
                    need = (stage - 1, "F", mb) if stage > 0 else None
                else:
                    need = (stage + 1, "B", mb) if stage < stages - 1 else (stage, "F", mb)
                if need is not None and need not in done:
                    break
                start = max(free[rank], done[need] if need is not None else 0.0)
                free[rank] = done[(stage, kind, mb)] = start + seconds
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError("simulated_bubble: the actions' dependencies cannot be met (an action is missing).")
    makespan = max(free.values())
    return 1.0 - busy / (len(actions) * makespan) if makespan > 0 else 0.0
