"""Straggler detection: which rank is persistently slowest before synchronisation.

An all-reduce evens out step times: every rank waits for the slowest, so the
slow rank hides behind identical step times. What differs is the time each
rank spends *outside* gradient synchronisation (``busy_s``: data wait,
forward, backward compute, optimizer; see :mod:`.profiler`). At every log
step (never in between) the ranks all-gather a handful of floats, and
:class:`StragglerDetector` names a rank when it was the slowest, by more than
``threshold`` over the median of the others, in most of the last ``window``
log steps.

Example::

    det = StragglerDetector(world_size=4)
    for busy in ([0.10, 0.10, 0.15, 0.10],) * 3:
        verdict = det.observe(busy)
    verdict.rank, round(verdict.slowdown, 2)    # (2, 0.5): rank 2 is 50% slower
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

GATHERED = ("busy_s", "data_wait_s", "forward_s", "backward_s", "comm_exposed_s", "optimizer_s")


@dataclass(frozen=True)
class Verdict:
    """A persistent straggler: ``rank`` is ``slowdown`` (0.5 = 50%) slower than the median other rank."""

    rank: int
    slowdown: float
    excess_s: float
    busy_s: float
    median_others_s: float
    hits: int
    windows: int

    def message(self) -> str:
        how = (
            f"is {self.slowdown * 100:.0f}% slower than"
            if self.slowdown < 1
            else f"is {1 + self.slowdown:.1f}x slower than"
        )
        return (
            f"straggler: rank {self.rank} {how} the median rank "
            f"({self.busy_s * 1e3:.1f} ms vs {self.median_others_s * 1e3:.1f} ms of compute per step, "
            f"+{self.excess_s * 1e3:.1f} ms) in {self.hits} of the last {self.windows} log steps"
        )


class StragglerDetector:
    """Pure decision logic over per-rank busy times (one list per log step).

    threshold: a rank counts as slowest in a window only if its busy time exceeds
      the median of the other ranks by more than this fraction (noise guard).
    window: how many recent log steps are considered.
    min_hits: the same rank must be slowest in at least this many of them, and in
      more than half of those observed.
    """

    def __init__(self, world_size: int, threshold: float = 0.1, window: int = 5, min_hits: int = 3) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.threshold = threshold
        self.min_hits = min_hits
        self._history: deque[tuple[int, float, float, float] | None] = deque(maxlen=window)
        self.last: Verdict | None = None

    def observe(self, busy: Sequence[float]) -> Verdict | None:
        """Add one log step's per-rank busy seconds; return the current verdict (or None)."""
        if len(busy) != self.world_size:
            raise ValueError(f"expected {self.world_size} busy times, got {len(busy)}")
        if self.world_size < 2:
            self.last = None
            return None
        slowest = max(range(self.world_size), key=lambda r: busy[r])
        others = [b for r, b in enumerate(busy) if r != slowest]
        median_others = statistics.median(others)
        ratio = busy[slowest] / median_others - 1.0 if median_others > 0 else 0.0
        self._history.append((slowest, ratio, busy[slowest], median_others) if ratio > self.threshold else None)
        counts: dict[int, list[tuple[int, float, float, float]]] = {}
        for entry in self._history:
            if entry is not None:
                counts.setdefault(entry[0], []).append(entry)
        verdict = None
        if counts:
            rank, entries = max(counts.items(), key=lambda kv: len(kv[1]))
            if len(entries) >= self.min_hits and len(entries) * 2 > len(self._history):
                slow = statistics.median(e[2] for e in entries)
                med = statistics.median(e[3] for e in entries)
                verdict = Verdict(
                    rank=rank,
                    slowdown=slow / med - 1.0 if med > 0 else 0.0,
                    excess_s=slow - med,
                    busy_s=slow,
                    median_others_s=med,
                    hits=len(entries),
                    windows=len(self._history),
                )
        self.last = verdict
        return verdict


class PendingGather:
    """An all_gather of short float vectors started with :func:`start_gather`; :meth:`result`
    waits for it (it completes in the background while training goes on)."""

    def __init__(self, work: Any, out: list[torch.Tensor]) -> None:
        self.work, self.out = work, out

    def result(self) -> list[list[float]]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return [t.tolist() for t in self.out]


def start_gather(values: Sequence[float], device: torch.device) -> PendingGather:
    """Start an all_gather of a short float vector from every rank (a collective: every rank
    starts it at the same point), without waiting for it: on a slow link its round trip
    hides behind the next steps instead of stalling this one."""
    import torch.distributed as dist

    if dist.get_backend() != "nccl":
        device = torch.device("cpu")  # gloo (and mpi) gather host tensors
    mine = torch.tensor(list(values), dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    return PendingGather(dist.all_gather(out, mine, async_op=True), out)


__all__ = ["GATHERED", "PendingGather", "StragglerDetector", "Verdict", "start_gather"]
