"""Straggler detection: which rank is persistently slowest before synchronisation.

An all-reduce evens out step times: every rank waits for the slowest, so the
slow rank hides behind identical step times. What differs is the time each
rank spends *outside* gradient synchronisation (``busy_s``: data wait,
forward, backward compute, optimizer; see :mod:`.profiler`). At every log
step (never in between) the ranks all-gather a handful of floats, and
:class:`StragglerDetector` names a rank only on an effect that is both large
and lasting:

* large: the slowest rank's busy time exceeds the median of the others by more
  than ``threshold`` (relative) *and* by more than ``min_excess_s`` (absolute);
* lasting: the same rank was that slowest in each of the last ``persist``
  exchanges in a row. Once named, it stays named while it is so in more than
  half of the last ``window`` exchanges, so one quiet window does not drop a
  real straggler and announce it again a window later.

Why both: the README's script on 2 CPU ranks (0.5-0.9 ms of compute per step on
a shared 2-core machine) had single windows where one rank was 10-160 % slower,
by up to 1 ms, and the slower rank changed from window to window: scheduler
noise, not a slow rank. The rule it replaced (slowest by 10 % in 3 of the last 5
exchanges) named such noise 2 to 7 times per 600-step run.

Example::

    det = StragglerDetector(world_size=4)
    for busy in ([0.10, 0.10, 0.15, 0.10],) * 3:   # 3 exchanges in a row, 50 ms over the median
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

from ..config import MetricsConfig

GATHERED = ("busy_s", "data_wait_s", "forward_s", "backward_s", "comm_exposed_s", "optimizer_s")

MIN_EXCESS_S = 0.002
"""The smallest excess compute per step (seconds) that can name a straggler: about one
scheduler time slice of a loaded host, below which a CPU rank's lead is noise (the README's
script on 2 shared cores: single windows up to 1 ms apart). A real straggler costs every rank
its excess each step; on steps of 100 ms and more the relative threshold decides."""
PERSIST_EXCHANGES = 3
"""Exchanges in a row (one per log step) the same rank must be the slow one before it is named."""
WINDOW_EXCHANGES = 5
"""A named straggler stays named while it is the slow one in more than half of this many."""


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

    threshold: a rank counts as slow in an exchange only if its busy time exceeds the
      median of the other ranks by more than this fraction ...
    min_excess_s: ... and by more than this many seconds (noise guards, relative and absolute).
    persist: it is named once it counted in each of the last ``persist`` exchanges in a row.
    window: a named rank stays named while it counts in more than half of the last ``window``.
    """

    def __init__(self, world_size: int, threshold: float = MetricsConfig.straggler_threshold,
                 min_excess_s: float = MIN_EXCESS_S, persist: int = PERSIST_EXCHANGES,
                 window: int = WINDOW_EXCHANGES) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 1 <= persist <= window:
            raise ValueError(f"persist must be in 1..window ({window}), got {persist}")
        self.world_size = world_size
        self.threshold = threshold
        self.min_excess_s = min_excess_s
        self.persist = persist
        # One entry per exchange: (slow rank, its busy s, median of the others) when an exchange
        # showed a large enough effect, else None.
        self._history: deque[tuple[int, float, float] | None] = deque(maxlen=window)
        self.last: Verdict | None = None

    def observe(self, busy: Sequence[float]) -> Verdict | None:
        """Add one log step's per-rank busy seconds; return the current verdict (or None)."""
        if len(busy) != self.world_size:
            raise ValueError(f"expected {self.world_size} busy times, got {len(busy)}")
        if self.world_size < 2:
            self.last = None
            return None
        slowest = max(range(self.world_size), key=lambda r: busy[r])
        median_others = statistics.median(b for r, b in enumerate(busy) if r != slowest)
        excess = busy[slowest] - median_others
        large = excess > self.min_excess_s and excess > self.threshold * median_others
        self._history.append((slowest, busy[slowest], median_others) if large else None)
        hits_of: dict[int, list[tuple[int, float, float]]] = {}
        for entry in self._history:
            if entry is not None:
                hits_of.setdefault(entry[0], []).append(entry)
        recent = list(self._history)[-self.persist:]
        if self.last is not None and len(hits_of.get(self.last.rank, ())) * 2 > len(self._history):
            rank = self.last.rank  # still the slow one, most of the time: kept
        elif len(recent) == self.persist and all(e is not None and e[0] == slowest for e in recent):
            rank = slowest  # the same rank, by a large margin, in each of the last exchanges
        else:
            self.last = None
            return None
        entries = hits_of[rank]
        slow = statistics.median(e[1] for e in entries)
        med = statistics.median(e[2] for e in entries)
        self.last = Verdict(
            rank=rank,
            slowdown=slow / med - 1.0 if med > 0 else 0.0,
            excess_s=slow - med,
            busy_s=slow,
            median_others_s=med,
            hits=len(entries),
            windows=len(self._history),
        )
        return self.last


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


__all__ = ["GATHERED", "MIN_EXCESS_S", "PERSIST_EXCHANGES", "WINDOW_EXCHANGES", "PendingGather", "StragglerDetector", "Verdict", "start_gather"]
