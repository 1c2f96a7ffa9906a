"""Live tensor bytes on CPU over a run, from the profiler's allocation events (the c10 CPU allocator's).

The profiler records every allocation and release on the thread that runs it (here: forward, backward, the
optimizer step, and the collectives' buffers that the main thread allocates). A release on another thread (gloo's) is
not recorded; where the allocator hands its address out again, the block is counted released there. Marks are
allocations of distinct odd sizes, so that they can be found in the event stream without relying on clocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["AllocationTimeline"]

_MARK_BASE = 100_003


def _walk(nodes: list[Any]) -> Iterator[Any]:
    for node in nodes:
        yield node
        yield from _walk(node.children)


class AllocationTimeline:
    """Use as a context manager around the run; call :meth:`mark` at points of interest inside it."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._names: list[str] = []
        self._profiler: Any = None

    def __enter__(self) -> AllocationTimeline:
        from torch.profiler import ProfilerActivity, profile

        if self.enabled:
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._profiler is not None:
            self._profiler.__exit__(*exc)

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        if name not in self._names:
            self._names.append(name)
        torch.empty(_MARK_BASE + 2 * self._names.index(name), dtype=torch.uint8)

    def live_bytes(self) -> tuple[dict[str, float], dict[str, float]]:
        """Bytes allocated since the start and still live: at each mark (its last occurrence) and the highest
        value between a mark and the next one (over all its occurrences), marks themselves excluded."""
        from torch._C._profiler import _EventType

        events = [n for n in _walk(self._profiler.profiler.kineto_results.experimental_event_tree())
                  if n.tag == _EventType.Allocation]  # fmt: skip
        events.sort(key=lambda n: n.start_time_ns)
        sizes = {_MARK_BASE + 2 * i: name for i, name in enumerate(self._names)}
        live = 0.0
        at: dict[str, float] = {}
        peak: dict[str, float] = {}
        phase = None
        allocated: dict[int, int] = {}
        for node in events:
            size = node.extra_fields.alloc_size
            if abs(size) in sizes:
                if size > 0:
                    phase = sizes[size]
                    at[phase] = live
                continue
            # Frees of blocks allocated before the profiler started (garbage of earlier work collected now) are
            # not part of this run: count only releases of blocks seen allocated.
            ptr = node.extra_fields.ptr
            if size > 0:
                # Two live blocks cannot share an address: one still "live" here was released on a thread the
                # profiler does not record (a collective's buffer freed on gloo's thread), before this allocation.
                live -= allocated.get(ptr, 0)
                allocated[ptr] = size
            elif allocated.pop(ptr, None) is None:
                continue
            live += size
            if phase is not None:
                peak[phase] = max(peak.get(phase, live), live)
        return at, peak
