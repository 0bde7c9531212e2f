"""How often in-memory snapshots are taken when healing in place chooses it: measured, then agreed.

Healing in place (``slipstream run --heal``) goes back to the last snapshot every rank holds, so
snapshots must be frequent; but each one holds the training loop while it copies the state
(:attr:`~slipstream.checkpoint.snapshots.MemorySnapshots.stall_s`). Every step is right for a
large step and a small model, and wrong for a small step and a large model. So, unless the user
set ``snapshot_every_steps``, the cadence is measured on the fly:

1. after a start or a restore, snapshots are taken every step; the first ``WARMUP_SNAPSHOTS``
   are not measured (each of the two slots' first write reserves and maps its buffer:
   ``posix_fallocate`` and page faults, not the steady cost);
2. the next ``MEASURED_SNAPSHOTS`` give this rank's stall (median) and its step time (median
   of the wall time between the end of one snapshot call and the next call: the step alone);
3. at that fixed step the ranks agree (one small all-reduce: the largest stall and the smallest
   step time of any rank), and every rank derives the same ``K`` from the same two numbers:
   the smallest ``K >= 1`` whose stall per step, ``stall / K``, is at most ``STALL_BUDGET``
   of the step time. Every rank must use the same ``K``: a heal goes back to a step whose
   snapshot every rank holds.

A restore (a heal, a restarted worker) starts again at 1.: the replacement of a dead rank
knows no measurement, and its slots are new.

On CUDA the copies are timed on the snapshot's own events, not as host wall time (a copy
waits for the step's queued kernels first: that is the step's time, not the snapshot's);
see :meth:`~slipstream.checkpoint.snapshots.MemorySnapshots.take`. The step time is host wall
time between two snapshot calls, which is right while measuring: each snapshot copies to host
memory and so synchronizes with the device at every measured step.

Example::

    every_steps_for(stall_s=0.003, step_s=0.045)      # 7: 0.43 ms per step of a 45 ms step (0.95%)
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

STALL_BUDGET = 0.01
"""The share of step time snapshots may take (1%), averaged over the steps between two."""
WARMUP_SNAPSHOTS = 2
"""Snapshots not measured after a start or a restore: the first write of each of the two slots."""
MEASURED_SNAPSHOTS = 3
"""Snapshots measured before the ranks agree (a median of three: one slow step does not decide)."""


def every_steps_for(stall_s: float, step_s: float, budget: float = STALL_BUDGET) -> int:
    """The smallest K >= 1 with ``stall_s / K <= budget * step_s``.

    Example::

        every_steps_for(0.0003, 0.045)   # 1: 0.3 ms of a 45 ms step is 0.7%
        every_steps_for(0.006, 0.010)    # 60
    """
    if stall_s <= 0:
        return 1
    if step_s <= 0:  # no time measured between two steps: as rare as one stall per 1/budget steps
        return max(1, math.ceil(1 / budget))
    # The tolerance keeps K from rounding up past an exact fit (0.003 / (0.01 * 0.1) is 3.0000000000000004).
    return max(1, math.ceil(stall_s / (budget * step_s) - 1e-9))


@dataclass(frozen=True)
class Choice:
    """The agreed cadence and the numbers it came from (the largest stall, the smallest step of any rank)."""

    every_steps: int
    stall_s: float
    step_s: float

    def line(self) -> str:
        """Rank 0's line, e.g. ``snapshots every 1 steps: stall 0.3 ms of a 45.0 ms step (0.7%)``."""
        share = 100 * self.stall_s / (self.every_steps * self.step_s) if self.step_s > 0 else 0.0
        return (f"[slipstream] snapshots every {self.every_steps} steps: stall {self.stall_s * 1e3:.1f} ms of a "
                f"{self.step_s * 1e3:.1f} ms step ({share:.1f}%)")


Agree = Callable[[float, float], tuple[float, float]]
"""(this rank's stall_s, step_s) -> (the largest stall_s, the smallest step_s) of every rank: a collective."""


class Cadence:
    """One rank's snapshot cadence: ``fixed`` steps (the user's ``snapshot_every_steps``), or None:
    measured and agreed (see the module docstring).

    The caller reports every optimizer step, on every rank, in the same order: :meth:`step_began`
    at the start of its snapshot call, :meth:`took` with the stall of a snapshot it took, and
    :meth:`step_ended` (which, at the deciding step, calls ``agree``: a collective).

    Example::

        cadence = Cadence(None)
        cadence.restart(0)
        for step in range(1, 100):
            cadence.step_began()
            if cadence.scheduled(step):
                cadence.took(step, measured_stall_s)
            choice = cadence.step_ended(step, agree)   # a Choice once, at step 5
    """

    def __init__(self, fixed: int | None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.fixed = fixed
        self.align = 1  # snapshot steps are multiples of it (align_to)
        self.every_steps = fixed if fixed is not None else 1
        self.choice: Choice | None = None
        self._clock = clock
        self._decide_at: int | None = None
        self._warm_after = 0
        self._stalls: list[float] = []
        self._steps: list[float] = []
        self._began: float | None = None
        self._ended: float | None = None

    @property
    def measuring(self) -> bool:
        return self._decide_at is not None

    def align_to(self, steps: int) -> None:
        """Snapshot only at multiples of ``steps``: the steps where every rank synchronizes (DiLoCo's
        outer step every H). Between two, ranks train alone and drift apart, so a survivor may have
        snapshotted steps the dead rank never reached and overwritten (two slots) the last one both
        hold: a heal then finds no common snapshot (seen at H=3: one heal of two under load). At
        a synchronizing step every rank has passed the previous one, so both slots share one."""
        self.align = max(1, steps)
        self.every_steps = self._aligned(self.fixed if self.fixed is not None else 1)

    def _aligned(self, every: int) -> int:
        return self.align * math.ceil(every / self.align)

    def restart(self, step: int) -> None:
        """Measure again from ``step`` (a start or a restore), snapshotting every step meanwhile.
        The same ``step`` on every rank, so every rank agrees at the same step."""
        if self.fixed is not None:
            return
        self.every_steps = self.align
        self._decide_at = step + (WARMUP_SNAPSHOTS + MEASURED_SNAPSHOTS) * self.align
        self._warm_after = step + WARMUP_SNAPSHOTS * self.align
        self._stalls, self._steps = [], []
        self._ended = None

    def scheduled(self, step: int) -> bool:
        """Whether ``step`` is a snapshot step (the same on every rank)."""
        return step > 0 and step % self.every_steps == 0

    def step_began(self) -> None:
        self._began = self._clock()

    def took(self, step: int, stall_s: float) -> None:
        """A snapshot of ``step`` held the loop ``stall_s`` (measured, after the warm-up)."""
        if self.measuring and step > self._warm_after:
            self._stalls.append(stall_s)

    def step_ended(self, step: int, agree: Agree | None) -> Choice | None:
        """After the snapshot call of ``step``: at the deciding step, agree (``agree``; None: one
        rank) and set :attr:`every_steps`; returns the new choice then, else None."""
        now = self._clock()
        if self.measuring and self._ended is not None and self._began is not None and step > self._warm_after:
            self._steps.append(max(0.0, self._began - self._ended))
        self._ended = now
        if not self.measuring or step < self._decide_at:  # type: ignore[operator]
            return None
        stall_s = statistics.median(self._stalls) if self._stalls else 0.0  # snapshots off here: nothing stalls
        step_s = statistics.median(self._steps) if self._steps else 0.0
        if agree is not None:
            stall_s, step_s = agree(stall_s, step_s)
        self._decide_at = None
        self.every_steps = self._aligned(every_steps_for(stall_s, step_s))
        self.choice = Choice(self.every_steps, stall_s, step_s)
        return self.choice
