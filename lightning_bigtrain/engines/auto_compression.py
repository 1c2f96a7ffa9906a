"""``compression="auto"``: the gradient exchange picked by timing real training steps on the run's own link.

Whether a compressor pays depends on how much of the step the exchange takes, and on what compressing costs where it
runs: on our shaped 100 Mbit/s link PowerSGD(4) made the char-GPT's step much faster than a 16-bit all-reduce, at 1
Gbit/s it was about as fast on one host and slower on another (its matrix products compete with backward for the
cores while a dense all-reduce waits on the wire; ``docs/compression.md``). A model of the link can miss the second
effect, so the choice is measured: the run's first optimizer steps are trials, ``trial_steps`` with each candidate
in turn (the dense option first), each rank timing its optimizer steps (forward, backward with the exchange
overlapped, update). After the last trial the ranks all-reduce their median step times (the slowest rank's counts:
it sets the pace) and every rank takes the same choice: the fastest compressor if it beats the dense option's median
by ``margin``, else the dense option. The first step of each trial is not timed (DDP rebuilds its buckets after its
first step; PowerSGD starts its factors).

The trials are training steps, not extra work. When the choice is the dense option, what the compressed trials'
messages left out (their error-feedback residual) is dropped, as is PowerSGD's warm start; the choice, the trials'
times and the step count are checkpointed with each rank's compression state, so a resumed run keeps its choice (or
finishes its trials).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_bigtrain.functional.compression import COMPRESSION_NAMES, Cast, Compressor, _Segment

if TYPE_CHECKING:
    from lightning_bigtrain.engines.compression import GradientCompression

__all__ = ["AutoCompression"]

DEFAULT_CANDIDATES = ("fp16", "powersgd")


def _resolve(candidate: Compressor | str, position: int) -> Compressor:
    if isinstance(candidate, str):
        if candidate not in COMPRESSION_NAMES:
            raise ValueError(
                f"`AutoCompression(candidates=...)`: candidate {position} is {candidate!r}; pass a compressor or one "
                f"of {', '.join(repr(k) for k in COMPRESSION_NAMES)}."
            )
        return COMPRESSION_NAMES[candidate]()
    if isinstance(candidate, AutoCompression) or not isinstance(candidate, Compressor):
        raise TypeError(
            f"`AutoCompression(candidates=...)`: candidate {position} is {candidate!r}; pass compressors from "
            "lightning_bigtrain.compression (Cast, Quantize, PowerSGD, TopK, OneBit) or their names."
        )
    return candidate


class AutoCompression(Compressor):
    """The exchange chosen by timing the run's first steps: a dense 16-bit all-reduce unless a compressor makes the
    step faster by ``margin`` (``CompressedDDPStrategy(compression="auto")`` is ``AutoCompression()``).

    Args:
        candidates: The dense option first (a ``Cast``: ``"fp16"`` or ``"bf16"``), then the compressors to try, as
            compressors or their names. Each runs for ``trial_steps`` optimizer steps at the start of the run; none
            may have ``warmup_steps`` of its own (the dense trial is the warm-up).
        trial_steps: Optimizer steps per candidate, >= 2 (the first of each is not timed): the median of the
            other ``trial_steps - 1`` is the candidate's step time.
        margin: The fraction of the dense option's step time by which a compressor must be faster to be chosen, in
            ``[0, 1)``: compression moves training away from dense, so it has to pay clearly.

    After the trials, :attr:`choice` is the chosen candidate and :attr:`step_seconds` the ranks' median step time
    per candidate (the slowest rank's).
    """

    name = "auto"

    def __init__(
        self,
        candidates: Sequence[Compressor | str] = DEFAULT_CANDIDATES,
        trial_steps: int = 4,
        margin: float = 0.1,
    ) -> None:
        if isinstance(candidates, (str, Compressor)) or len(candidates) < 2:
            raise ValueError(
                f"`AutoCompression(candidates={candidates!r})`: pass the dense option and at least one compressor, "
                "e.g. ('fp16', 'powersgd')."
            )
        resolved = [_resolve(c, i) for i, c in enumerate(candidates)]
        if not isinstance(resolved[0], Cast):
            raise ValueError(
                f"`AutoCompression(candidates=...)`: the first candidate is the dense option the others must beat; "
                f"it is {resolved[0]!r}. Put 'fp16' or 'bf16' (a Cast) first."
            )
        for i, c in enumerate(resolved):
            if c.warmup_steps:
                raise ValueError(
                    f"`AutoCompression(candidates=...)`: candidate {i} ({c!r}) has warmup_steps={c.warmup_steps}; "
                    "leave it at 0 (the dense trial comes first)."
                )
        if isinstance(trial_steps, bool) or not isinstance(trial_steps, int) or trial_steps < 2:
            raise ValueError(
                f"`AutoCompression(trial_steps={trial_steps!r})`: pass an int >= 2 (the first step of each trial "
                "is not timed)."
            )
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin < 1.0:
            raise ValueError(f"`AutoCompression(margin={margin!r})`: pass a fraction in [0, 1).")
        self.candidates = tuple(resolved)
        self.trial_steps = trial_steps
        self.margin = float(margin)
        self.reset()

    def reset(self) -> None:
        """Back to before the trials (a new engine: a new run, or the same object passed to another Trainer)."""
        self.step = 0  # optimizer steps completed (the engine's count)
        self.times: list[list[float]] = [[] for _ in self.candidates]  # this rank's timed steps per candidate
        self.step_seconds: list[float] | None = None  # the ranks' medians (max over ranks), once decided
        self.chosen: int | None = None

    # -- the candidate in use --
    @property
    def trial_length(self) -> int:
        """Optimizer steps the trials take: ``trial_steps`` per candidate."""
        return self.trial_steps * len(self.candidates)

    @property
    def active(self) -> Compressor:
        """The compressor this step uses: a trial's candidate, or the choice after the trials."""
        if self.chosen is not None:
            return self.candidates[self.chosen]
        return self.candidates[min(self.step // self.trial_steps, len(self.candidates) - 1)]

    @property
    def choice(self) -> Compressor | None:
        """The chosen candidate (None while trials run)."""
        return None if self.chosen is None else self.candidates[self.chosen]

    @property
    def error_feedback(self) -> bool:  # type: ignore[override]
        return self.active.error_feedback

    @property
    def min_compress_numel(self) -> int:  # type: ignore[override]
        return self.active.min_compress_numel

    @property
    def warmup_steps(self) -> int:  # type: ignore[override]
        return 0

    def compressible(self, shape: torch.Size) -> bool:
        return self.active.compressible(shape)

    def sent_bytes(self, shape: torch.Size, element_size: int, world: int) -> float:
        return self.active.sent_bytes(shape, element_size, world)

    def reduce_scatter_bytes(self, shape: torch.Size, element_size: int, world: int) -> float:
        return self.active.reduce_scatter_bytes(shape, element_size, world)

    def exchange(self, engine: GradientCompression, compressed: list[_Segment], dense: list[_Segment]) -> None:
        self.active.exchange(engine, compressed, dense)

    # -- the trials --
    @property
    def deciding(self) -> bool:
        """Whether the trials still run (the strategy times its steps and calls :meth:`record` only then)."""
        return self.chosen is None

    def record(self, seconds: float, engine: GradientCompression, device: torch.device) -> bool:
        """Note one finished optimizer step of ``seconds`` on this rank (call on every rank while :attr:`deciding`,
        after the engine counted the step). Returns True on the step that took the decision (a collective: all
        ranks call it)."""
        index = self.step // self.trial_steps
        if self.chosen is None and index < len(self.candidates) and self.step % self.trial_steps:
            self.times[index].append(float(seconds))
        before = self.active
        self.step = engine.step
        if self.chosen is None and self.step >= self.trial_length:
            self._decide(engine, device)
        if self.active is not before:  # the next step uses another compressor: it starts as at a run's start
            engine.drop_carried_state()
        return self.chosen is not None and self.step == self.trial_length

    def _decide(self, engine: GradientCompression, device: torch.device) -> None:
        medians = torch.tensor([statistics.median(t) if t else float("inf") for t in self.times], device=device,
                               dtype=torch.float64)  # fmt: skip
        if engine.global_world > 1:  # over every rank: a node's ranks must agree too (hierarchical exchange)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX, group=engine.global_group)  # the slowest rank sets the pace
        self.step_seconds = medians.tolist()
        dense = self.step_seconds[0]
        best = min(range(1, len(self.candidates)), key=lambda i: self.step_seconds[i])  # type: ignore[index]
        self.chosen = best if self.step_seconds[best] < (1.0 - self.margin) * dense else 0

    def summary(self) -> str:
        """The decision in a sentence (for the log)."""
        if self.chosen is None or self.step_seconds is None:
            return f"compression='auto': trials running ({self.step} of {self.trial_length} steps)"
        timings = ", ".join(f"{c!r} {s:.3g} s" for c, s in zip(self.candidates, self.step_seconds, strict=True))
        return (
            f"compression='auto' chose {self.candidates[self.chosen]!r} after timing {self.trial_steps} steps of each "
            f"candidate (median step, slowest rank: {timings}; a compressor must be {100 * self.margin:.0f}% "
            "faster than the dense option)."
        )

    # -- checkpoint (per rank, with the engine's state) --
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "times": [list(t) for t in self.times], "chosen": self.chosen,
                "step_seconds": self.step_seconds}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.times = [list(t) for t in state["times"]]
        self.chosen = state["chosen"]
        self.step_seconds = state["step_seconds"]

    def _args(self) -> str:
        return f"candidates={self.candidates!r}, trial_steps={self.trial_steps}, margin={self.margin}"
