"""Unstructured and N:M pruning as plain functions on tensors: schedules, scores, masks, reports.

Masks are boolean tensors shaped like the weight they belong to (``True`` keeps the entry). Scores rank
entries (low scores are pruned first); entries already pruned must be given the score ``-inf`` so that a
growing sparsity never revives them. Works on local shards too: pass ``group`` and the thresholds come from
counts all-reduced over the group (no rank ever holds another rank's weights).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "SparsityRow",
    "check_nm_shape",
    "cubic_sparsity",
    "magnitude_scores",
    "movement_update_",
    "nm_mask",
    "parse_nm",
    "sparsity_masks",
    "sparsity_rows",
    "to_dense_state_dict",
    "to_sparse_state_dict",
]


def cubic_sparsity(step: int, *, final: float, start: int, end: int, initial: float = 0.0) -> float:
    """Sparsity at optimizer step ``step`` of the gradual schedule of Zhu & Gupta (2017), "To prune, or not to
    prune", eq. 1: ``s_t = s_f + (s_i - s_f) * (1 - (t - t_0) / (t_end - t_0))**3``, nothing is pruned before ``t_0``,
    ``s_f`` from ``t_end`` on. Pruning is fast while many redundant weights remain and slows as it nears the end."""
    if step < start:
        return 0.0
    if end <= start or step >= end:
        return final
    progress = (step - start) / (end - start)
    return final + (initial - final) * (1.0 - progress) ** 3


def magnitude_scores(weight: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``|w|`` in fp32, with entries already pruned by ``mask`` set to ``-inf``."""
    scores = weight.detach().abs().float()
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return scores


def movement_update_(scores: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor) -> None:
    """Accumulate movement scores in place: ``S -= grad * w`` per optimizer step (Sanh et al., 2020, "Movement
    Pruning", first-order scores). Weights moving away from zero gain score; those shrinking toward it lose it."""
    scores.sub_(grad.detach().float() * weight.detach().float())


def parse_nm(pattern: str) -> tuple[int, int]:
    """``"2:4"`` -> ``(2, 4)``: keep ``n`` entries of every ``m`` consecutive ones."""
    try:
        n_text, m_text = pattern.split(":")
        n, m = int(n_text), int(m_text)
    except ValueError:
        raise ValueError(f"pattern={pattern!r}: expected 'N:M' with integers, e.g. '2:4'.") from None
    if not 0 < n < m:
        raise ValueError(f"pattern={pattern!r}: need 0 < N < M (keep N of every M weights), e.g. '2:4'.")
    return n, m


def check_nm_shape(shape: Sequence[int], m: int) -> str | None:
    """Why a weight of ``shape`` cannot take an N:M pattern along its input dimension, or None if it can.

    Groups of ``m`` run along the flattened input dimension (everything but dim 0: ``in_features`` of a Linear,
    ``in_channels * kernel`` of a convolution), where sparse tensor cores read them."""
    if len(shape) < 2:
        return f"a {len(shape)}-D tensor has no input dimension"
    columns = math.prod(shape[1:])
    if columns % m:
        return f"its input size {columns} is not a multiple of {m}"
    return None


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` highest-scoring entries of every ``m`` consecutive ones along the input dimension."""
    reason = check_nm_shape(scores.shape, m)
    if reason is not None:
        raise ValueError(f"N:M mask for shape {tuple(scores.shape)}: {reason}.")
    groups = scores.reshape(scores.shape[0], -1, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)
    return keep.reshape(scores.shape)


def sparsity_masks(
    scores: Sequence[torch.Tensor],
    sparsity: float,
    *,
    scope: str = "global",
    numels: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    sharded: bool = False,
) -> list[torch.Tensor]:
    """Masks pruning the lowest-scoring fraction ``sparsity`` of the entries.

    Args:
        scores: One score tensor per weight (``-inf`` for entries that must stay pruned).
        sparsity: Fraction of entries to prune, in ``[0, 1)``.
        scope: ``"global"`` ranks all entries together (layers end up with different sparsities); ``"layer"``
            prunes each tensor to ``sparsity`` on its own.
        numels: Full sizes of the tensors when ``scores`` are local shards (default: their own sizes).
        group: Process group over which shards are spread (with ``sharded=True``).
        sharded: ``scores`` are this rank's shards; thresholds come from counts all-reduced over ``group``
            (bisection on the score value; ties at the threshold are kept).
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity={sparsity}: must be in [0, 1).")
    if scope not in ("global", "layer"):
        raise ValueError(f"scope={scope!r}: expected 'global' or 'layer'.")
    if not scores:
        return []
    sizes = list(numels) if numels is not None else [s.numel() for s in scores]
    members = [list(range(len(scores)))] if scope == "global" else [[i] for i in range(len(scores))]
    targets = [round(sparsity * sum(sizes[i] for i in idx)) for idx in members]
    masks: list[torch.Tensor | None] = [None] * len(scores)
    if not sharded:
        for idx, k in zip(members, targets, strict=True):
            flat = torch.cat([scores[i].reshape(-1) for i in idx])
            keep = torch.ones_like(flat, dtype=torch.bool)
            if k > 0:
                # Stable sort: equal scores (e.g. zeros) are pruned in a fixed order, identically on every rank.
                keep[torch.argsort(flat, stable=True)[:k]] = False
            for i, part in zip(idx, keep.split([scores[i].numel() for i in idx]), strict=True):
                masks[i] = part.reshape(scores[i].shape)
        return [m for m in masks if m is not None]
    thresholds = _bisect_thresholds(scores, members, targets, group)
    for idx, t in zip(members, thresholds, strict=True):
        for i in idx:
            masks[i] = scores[i] > t if not math.isnan(t) else torch.ones_like(scores[i], dtype=torch.bool)
    return [m for m in masks if m is not None]


def _bisect_thresholds(
    scores: Sequence[torch.Tensor],
    members: list[list[int]],
    targets: list[int],
    group: dist.ProcessGroup | None,
    iterations: int = 64,
) -> list[float]:
    """Per member set, the smallest score ``t`` with ``count(score <= t) >= k`` over all ranks (NaN for k = 0).

    All member sets bisect together, so each iteration costs one all-reduce of a small vector."""
    device = scores[0].device
    finite = [s[torch.isfinite(s)] for s in scores]
    lo = torch.tensor([min((f.min().item() for i in idx if (f := finite[i]).numel()), default=0.0) for idx in members],
                      dtype=torch.float64, device=device)  # fmt: skip
    hi = torch.tensor([max((f.max().item() for i in idx if (f := finite[i]).numel()), default=0.0) for idx in members],
                      dtype=torch.float64, device=device)  # fmt: skip
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    lo = lo - 1.0  # count(score <= lo) counts only the -inf entries: below every target once they are counted
    k = torch.tensor(targets, dtype=torch.float64, device=device)
    for _ in range(iterations):
        mid = (lo + hi) / 2
        bounds = mid.tolist()
        counts = torch.tensor(
            [sum(int(torch.count_nonzero(scores[i] <= bounds[j])) for i in idx) for j, idx in enumerate(members)],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(counts, group=group)
        enough = counts >= k
        hi = torch.where(enough, mid, hi)
        lo = torch.where(enough, lo, mid)
    return [float("nan") if t == 0 else h for t, h in zip(targets, hi.tolist(), strict=True)]


@dataclass(frozen=True)
class SparsityRow:
    """One line of the per-layer sparsity report."""

    name: str
    shape: tuple[int, ...]
    numel: int
    zeros: int

    @property
    def sparsity(self) -> float:
        return self.zeros / self.numel if self.numel else 0.0


def sparsity_rows(named: Sequence[tuple[str, torch.Tensor]]) -> list[SparsityRow]:
    """Per tensor: how many entries are exactly zero (full tensors; gather shards first)."""
    return [SparsityRow(name, tuple(t.shape), t.numel(), int((t == 0).sum())) for name, t in named]


def to_sparse_state_dict(state_dict: dict[str, torch.Tensor], min_sparsity: float = 0.85) -> dict[str, torch.Tensor]:
    """A copy of ``state_dict`` with every floating tensor at least ``min_sparsity`` zeros stored as a sparse COO
    tensor (one int64 index per dimension plus the value per nonzero: a 2-D fp32 weight gets smaller on disk
    above 80% sparsity). Undo with
    :func:`to_dense_state_dict` before ``load_state_dict``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and value.numel()
            and value.layout == torch.strided
        ) and float((value == 0).sum()) / value.numel() >= min_sparsity:
            out[key] = value.detach().to_sparse().coalesce()
            continue
        out[key] = value
    return out


def to_dense_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`to_sparse_state_dict`."""
    return {k: v.to_dense() if isinstance(v, torch.Tensor) and v.is_sparse else v for k, v in state_dict.items()}
