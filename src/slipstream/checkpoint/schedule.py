"""When a checkpoint is due: the interval, the clock and a stop request, agreed by every rank.

The manager's :meth:`~.manager.CheckpointManager.should_save` and SIGTERM handler live here
(:class:`SaveSchedule`); the manager forwards to them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..errors import EXIT_PREEMPTED
from .context import ManagerContext

log = logging.getLogger("slipstream.checkpoint")

# The most steps between two agreements of the stop flag and the save clock (1 ms steps: a stop seen 0.1 s later).
STOP_CHECK_MAX_STEPS = 100


def _exit_now(code: int) -> None:
    log.error("preemption deadline passed before a checkpoint could be written; exiting with %d", code)
    os._exit(code)


class SaveSchedule:
    """Decides, the same on every rank, when a save is due and whether the job was preempted.

    ``stop_check_s``: how often (in time) the ranks agree on a stop request and on ``every_s``'s
    clock, both rank-local (checked by the manager, below ``preemption_deadline_s``).
    """

    def __init__(self, ctx: ManagerContext, stop_check_s: float) -> None:
        self.ctx = ctx
        self.stop_check_s = stop_check_s
        self.restart()

    def restart(self) -> None:
        """Agree again from the next step, as a new manager does (after a heal in place too)."""
        # should_save's agreements: the step of the last one (None: none yet), the next step
        # that agrees (both the same on every rank), and when this rank left the last one.
        self.agreed_step: int | None = None
        self.next_agreement_step = 0
        self.agreed_at = time.monotonic()

    def on_sigterm(self, signum: int, frame: Any) -> None:
        # Only a flag: the save happens at the next step boundary, together with
        # every other rank (a checkpoint is a collective). A rank that never
        # reaches a boundary (stuck, or its peers are gone) still exits by the
        # deadline, before the agent or the kubelet resorts to SIGKILL.
        if self.ctx.preempt_requested:
            return
        self.ctx.preempt_requested = True
        timer = threading.Timer(self.ctx.settings.preemption_deadline_s, _exit_now, args=(EXIT_PREEMPTED,))
        timer.daemon = True
        timer.start()

    def should_save(self, step: int) -> tuple[bool, bool]:
        """(save now, preempted), the same on every rank at every step.

        ``every_steps`` is the same number on every rank: a step on the interval saves
        without asking the others. The clock (``every_s``) and a stop request (SIGTERM
        may reach one rank alone) are rank-local, so they are agreed, in one small
        all-reduce on the checkpoint's gloo group, on agreement steps only: every step
        on the interval, and otherwise about every ``stop_check_s``. The gap to the
        next agreement is counted in steps, from the slowest rank's step time since
        the last one (an agreed number, so every rank skips the same steps), at most
        ``STOP_CHECK_MAX_STEPS``. A stop request thus starts the emergency checkpoint
        about ``stop_check_s`` (+ one step) after the signal, and a step between two
        agreements runs no host collective (it ran one every step: a host barrier
        across nodes). A single process checks both every step.

        Example::

            save, preempted = mgr.should_save(step)   # every rank, every step, same step numbers
        """
        ctx, every_steps, every_s = self.ctx, self.ctx.settings.every_steps, self.ctx.settings.every_s
        if ctx.directory is None:  # in-memory snapshots only: nothing to save, no stop request to agree on
            return False, False
        due = every_steps is not None and step % every_steps == 0
        if not ctx.many:
            timed = every_s is not None and time.monotonic() - ctx.last_save_time >= every_s
            return due or timed or ctx.preempt_requested, ctx.preempt_requested
        between = self.agreed_step is not None and self.agreed_step < step < self.next_agreement_step
        if between and not due:
            return False, False
        now = time.monotonic()
        timed = every_s is not None and now - ctx.last_save_time >= every_s
        # This rank's mean step time since the last agreement (none yet: as if one step took
        # stop_check_s, so the next step agrees again and measures).
        gap = step - self.agreed_step if self.agreed_step is not None and step > self.agreed_step else 0
        step_s = (now - self.agreed_at) / gap if gap else self.stop_check_s
        flags = torch.tensor([float(timed), float(ctx.preempt_requested), step_s], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=ctx.group)
        save, preempted, slowest_s = bool(flags[0]) or due, bool(flags[1]), float(flags[2])
        ahead = int(self.stop_check_s / slowest_s) if slowest_s > 0 else STOP_CHECK_MAX_STEPS
        self.agreed_step, self.agreed_at = step, time.monotonic()
        self.next_agreement_step = step + max(1, min(STOP_CHECK_MAX_STEPS, ahead))
        return save or preempted, preempted
