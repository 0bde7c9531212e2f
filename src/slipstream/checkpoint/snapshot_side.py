"""The in-memory side of a :class:`~slipstream.checkpoint.manager.CheckpointManager`.

:class:`SnapshotSide` keeps the registered state in host-memory snapshots (:mod:`.snapshots`)
at a fixed or measured cadence (:mod:`.cadence`), optionally copied to a rank on another node
(:mod:`.peer`), and keeps that copy's group through a heal in place. The manager's restore
reads the snapshots back (:mod:`.restoring`).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from ..log import CONSOLE
from ..resilience import heal
from . import peer, snapshots
from .context import ManagerContext

log = logging.getLogger("slipstream.checkpoint")


class SnapshotSide:
    """In-memory snapshots (every ``every_steps``, or ``auto``: :mod:`.cadence`) when an elastic agent
    would restart a failed worker to use them; ``peer_copy``: also on another node (:mod:`.peer`).
    ``snapshots`` is None when none are kept."""

    def __init__(self, ctx: ManagerContext, every_steps: int | None, auto: bool, peer_copy: bool) -> None:
        self.ctx = ctx
        self.peer_copy_wanted = False
        self.said_cadence: object = None  # rank 0: the cadence line printed last (cadence.Choice)
        self.snapshots = self._open(every_steps, auto, peer_copy)

    def _open(self, every_steps: int | None, auto: bool, peer_copy: bool) -> snapshots.MemorySnapshots | None:
        ctx = self.ctx
        if every_steps is None and not auto:
            return None
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            if ctx.rank == 0:
                log.warning("snapshot_every_steps is set but no elastic agent (slipstream run, torchrun) started "
                            "this process to restart it: no in-memory snapshots")
            return None
        snaps = snapshots.MemorySnapshots.for_run(ctx.directory, ctx.rank, ctx.world_size, every_steps)
        self.peer_copy_wanted = peer_copy and ctx.group is not None and ctx.world_size > 1
        # A replacement healing in place makes its copy in rejoined(): its default group is fake until then.
        if self.peer_copy_wanted and not heal.on_fake_group():
            snaps.peer = peer.PeerCopy.for_job(ctx.rank, ctx.group, snaps.peer_slots)
        return snaps

    def maybe_snapshot(self, step: int) -> bool:
        """See :meth:`slipstream.checkpoint.manager.CheckpointManager.maybe_snapshot`."""
        if self.snapshots is None:
            return False
        ctx = self.ctx
        took, choice = self.snapshots.on_step(step, ctx.shared, ctx.per_rank, self._agree_cadence if ctx.many else None)
        if choice is not None and ctx.rank == 0 and choice != self.said_cadence:
            self.said_cadence = choice
            log.info(choice.line(), extra=CONSOLE)
        return took

    def _agree_cadence(self, stall_s: float, step_s: float) -> tuple[float, float]:
        """(the largest stall, the smallest step time) of every rank: one all-reduce."""
        values = torch.tensor([stall_s, -step_s], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.ctx.group)
        return float(values[0]), -float(values[1])

    def left(self) -> None:
        """Healing in place: the peer copy's group went with the broken default group."""
        if self.snapshots is not None and self.snapshots.peer is not None:
            self.snapshots.peer.left()

    def rejoined(self) -> None:
        """After a heal in place, once the manager's new groups exist (a collective when copying to a peer)."""
        if self.snapshots is not None:
            self.snapshots.mark_restarted()
            if self.peer_copy_wanted:  # a new copy on the new group (a collective, as at the start)
                self.snapshots.peer = peer.PeerCopy.for_job(self.ctx.rank, self.ctx.group, self.snapshots.peer_slots)

    def close(self) -> None:
        if self.snapshots is not None and self.snapshots.peer is not None:
            self.snapshots.peer.close()
