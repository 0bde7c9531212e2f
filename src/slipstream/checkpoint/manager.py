"""CheckpointManager: a registry of stateful objects saved and restored together.

Shared (replicated) state goes through torch.distributed.checkpoint (DCP), so a
checkpoint written at one world size loads at another. Per-rank state (RNG
streams, error-feedback buffers) goes to one small ``rank<R>.pt`` per rank in
the same directory. See :mod:`slipstream.checkpoint.layout` for why a
checkpoint is either complete or ignored.

Example::

    mgr = CheckpointManager("ckpt", every_steps=100, keep_last=2)
    mgr.register("model_and_optimizer", ModelOptimizerState(ddp_model, optimizer))
    mgr.register("rng", RNGState(), per_rank=True)
    step = mgr.restore_latest()      # 0 when there is nothing to resume
    ...
    mgr.maybe_save(step)             # every 100 steps, or when preempted

Checkpoints are verified before they are loaded (:mod:`.verify`); a save that
fails (a full disk, say) is reported in one line (:mod:`.storage`) and retried
at the next interval, up to ``max_failures`` times in a row.

``directory`` may be an fsspec URL (``s3://bucket/run1``): the same files go
to the object store, committed by a marker put last instead of a rename
(:mod:`.remote`).

``directory=None`` (a run healing in place with no ``checkpoint_dir``): the same registry
kept in in-memory snapshots only (:mod:`.snapshots`), for a heal to go back to; nothing
is written to disk, no lease is taken, and SIGTERM is left to the script.

The manager is a facade over one part per responsibility, which share a
:class:`~.context.ManagerContext`: the save clock and stop request (:mod:`.schedule`),
the save path (:mod:`.saving`), the load path (:mod:`.restoring`) and the in-memory
snapshots (:mod:`.snapshot_side`).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ..config import CheckpointConfig
from ..errors import ConfigError
from ..process import runtime
from ..resilience import heal
from . import lease, remote
from .context import ManagerContext
from .restoring import NoUsableCheckpoint, Restorer
from .saving import Saver
from .schedule import STOP_CHECK_MAX_STEPS, SaveSchedule
from .snapshot_side import SnapshotSide

log = logging.getLogger("slipstream.checkpoint")

# Importable from here as before the manager was split (the schedule and the restore path own them now).
__all__ = ["STOP_CHECK_MAX_STEPS", "CheckpointManager", "NoUsableCheckpoint"]


class CheckpointManager:
    """Saves and restores registered objects together (see the module's example).

    ``device``: where per-rank tensors saved from a GPU are restored; default
    this rank's device (:func:`slipstream.checkpoint.safe_load.default_device`).
    Checkpoint files are read as plain data only: a file holding pickled
    objects is refused (:class:`~slipstream.checkpoint.safe_load.CheckpointRefused`).
    ``verify``: how a checkpoint is checked before loading (``full``, ``size``,
    ``off``; see :mod:`slipstream.checkpoint.verify`). ``max_failures``: saves
    that may fail in a row before the run gives up with exit 1.
    ``stop_check_s``: how often (in time) the ranks agree on a stop request and on
    ``every_s``'s clock, both rank-local; see :meth:`should_save`.
    ``lease_interval_s``/``lease_stale_after_s``: rank 0 holds the directory's
    writer lease (:mod:`.lease`), beating every interval; another live job on
    the same directory is refused with :class:`~slipstream.checkpoint.lease.CheckpointDirInUse`
    (exit 2) on every rank. :meth:`close` releases it.
    ``storage_options``: passed to fsspec when ``directory`` is a URL (else the
    environment configures it: ``AWS_ENDPOINT_URL``, ``FSSPEC_S3_...``).
    """


    def __init__(
        self,
        directory: str | None,
        *,
        every_steps: int | None = None,
        every_s: float | None = None,
        keep_last: int = 3,
        async_save: bool = False,
        handle_sigterm: bool = True,
        preemption_deadline_s: float = 25.0,
        stop_check_s: float = 1.0,
        device: torch.device | str | None = None,
        verify: str = "full",
        max_failures: int = 3,
        lease_interval_s: float = lease.DEFAULT_INTERVAL_S,
        lease_stale_after_s: float | None = None,
        storage_options: Mapping[str, Any] | None = None,
        snapshot_every_steps: int | None = None,
        snapshot_peer_copy: bool = True,
        snapshot_auto: bool = False,
    ) -> None:
        # Every bound the run's settings have is checked where they are declared, with the same
        # message whether they came from a config, a job spec or this call (issue #44).
        self.settings = CheckpointConfig(
            dir=directory, every_steps=every_steps, every_s=every_s, keep_last=keep_last, async_save=async_save,
            verify=verify, max_failures=max_failures, preemption_deadline_s=preemption_deadline_s,
            snapshot_every_steps=snapshot_every_steps, snapshot_peer_copy=snapshot_peer_copy,
        )
        # What only this class takes (no run setting declares them): checked here, once.
        if directory is None and snapshot_every_steps is None and not snapshot_auto:
            raise ConfigError("a checkpoint manager without a directory keeps in-memory snapshots only: "
                              "give snapshot_every_steps or snapshot_auto")
        if not 0 < stop_check_s < preemption_deadline_s:
            raise ConfigError(f"stop_check_s must be > 0 and below preemption_deadline_s ({preemption_deadline_s}), "
                              f"got {stop_check_s:g}")
        directory = remote.local_path(directory) if directory is not None else None
        # An object store (a URL): the filesystem, made on every rank alike (a missing
        # fsspec is the same ConfigError everywhere); None for a local directory.
        fs = remote.filesystem(directory, storage_options) if directory and remote.is_url(directory) else None
        if directory is not None and fs is None and os.path.exists(directory) and not os.path.isdir(directory):
            raise ConfigError(f"checkpoint_dir exists and is not a directory: {directory}")
        self.ctx = ctx = ManagerContext(
            settings=self.settings, directory=directory, fs=fs, storage_options=dict(storage_options or {}),
            rank=dist.get_rank() if dist.is_initialized() else 0,
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
        )
        # Checkpoint collectives get their own gloo groups, so they stay on the
        # CPU whatever the training backend: `group` for the main thread (flag
        # exchange, barriers, synchronous saves, loads) and `writer_group` for
        # asynchronous saves, whose collectives run in a background thread and
        # must never interleave with the main thread's on one group.
        # Both carry the run's collective timeout: a peer lost in a save or a load
        # fails the survivors as soon as a lost training collective would.
        if dist.is_initialized():
            self._make_groups()
        self.schedule = SaveSchedule(ctx, stop_check_s)
        if ctx.rank == 0 and fs is None and directory is not None:
            os.makedirs(directory, exist_ok=True)
        # Before any write, and agreed by all ranks (a refusal raises on every rank).
        # A replacement healing in place decides alone (its group is the fake one until it joins).
        agree_on = None if heal.on_fake_group() else ctx.group
        self.saver = Saver(ctx, None if directory is None else lease.take_for_job(
            directory, rank=ctx.rank, world_size=ctx.world_size, group=agree_on, interval_s=lease_interval_s,
            stale_after_s=lease_stale_after_s, storage_options=storage_options))
        # None: nothing to write at a preemption, so SIGTERM is left to the script.
        if handle_sigterm and directory is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.schedule.on_sigterm)
        self.memory = SnapshotSide(ctx, snapshot_every_steps, snapshot_auto, snapshot_peer_copy)
        self.restorer = Restorer(ctx, self.memory, torch.device(device) if device is not None else None)

    def _make_groups(self) -> None:
        # A replacement healing in place (slipstream.resilience.heal) runs on a fake default group until it
        # joins the survivors: its side groups are fake too until then (see rejoined()).
        backend = heal.side_group_backend()
        self.ctx.group = dist.new_group(backend=backend, timeout=runtime.group_timeout())
        self.ctx.writer_group = (dist.new_group(backend=backend, timeout=runtime.group_timeout())
                                 if self.settings.async_save else None)

    def left(self) -> None:
        """Healing in place, before the broken default group is destroyed: drop every reference to
        this manager's groups (they are destroyed with it), so their sockets close."""
        self.ctx.group = self.ctx.writer_group = None
        self.memory.left()

    def rejoined(self) -> None:
        """After a heal in place (:mod:`slipstream.resilience.heal`): new side groups (a collective, every rank in
        one order). A save in flight is let go: it commits only if every rank's part was written."""
        self.saver.let_go()
        self.schedule.restart()  # as a new manager's
        self._make_groups()
        self.memory.rejoined()

    # --- registry ----------------------------------------------------------------------
    def register(self, name: str, obj: Any, per_rank: bool = False) -> None:
        """Save and restore ``obj`` (anything with state_dict()/load_state_dict())."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(f"checkpoint state {name!r} needs state_dict() and load_state_dict()")
        if name in self.ctx.shared or name in self.ctx.per_rank:
            raise ConfigError(f"checkpoint state {name!r} is registered twice")
        (self.ctx.per_rank if per_rank else self.ctx.shared)[name] = obj

    def register_restored(self, name: str, obj: Any) -> bool:
        """Register shared ``obj`` after :meth:`restore_latest`, and load its state from what that
        restored, when it holds an entry ``name``; True when it did. A collective when the restore
        was from disk: every rank registers the same objects in the same order.

        For an object that can only be built once the run exists (a data loader split by the
        layout's data-parallel rank). Example::

            mgr.restore_latest()
            mgr.register_restored("extra.data", loader)   # the loader goes on where the checkpoint was
        """
        self.register(name, obj)
        return self.restorer.load_late(name, obj)

    # --- snapshots, saving, restoring: forwarded to the part that owns each -------------
    def maybe_snapshot(self, step: int) -> bool:
        """Snapshot ``step`` in host memory when due (True: taken). Call it at every optimizer step on
        every rank: a measured cadence (:mod:`.cadence`) times the steps and agrees once (a collective)."""
        return self.memory.maybe_snapshot(step)

    def should_save(self, step: int) -> tuple[bool, bool]:
        """(save now, preempted), the same on every rank at every step (:meth:`.SaveSchedule.should_save`).

        Example::

            save, preempted = mgr.should_save(step)   # every rank, every step, same step numbers
        """
        return self.schedule.should_save(step)

    def maybe_save(self, step: int) -> bool:
        """Save when due; returns True when the job was preempted (and saved)."""
        save, preempted = self.should_save(step)
        if save:
            self.save(step, blocking=preempted)
        return preempted

    def save(self, step: int, blocking: bool = False) -> bool:
        """Write a checkpoint of ``step`` (asynchronously when configured and not ``blocking``).

        Returns False when it failed (reported, see :meth:`.Saver._save_failed`); an
        asynchronous save's outcome is known at the next :meth:`wait`. Every
        phase ends with all ranks agreeing on success, so a rank whose write
        failed and one whose write succeeded reach the same collectives.
        """
        return self.saver.save(step, blocking)

    def save_final(self, step: int) -> bool:
        """The run's last checkpoint: wait for a save in flight, then write ``step``
        (blocking) unless the newest agreed save is ``step`` already (or ``step`` is 0).

        Every rank takes the same branch: it is decided on :attr:`last_saved_step`,
        which only an agreement sets, never on rank 0's writer thread having
        committed (the save is a collective: a rank that skipped it alone left the
        others waiting in its first all-reduce until the timeout).

        Example::

            mgr.save_final(run.step_count)   # in every rank's run.finish()
        """
        return self.saver.save_final(step)

    def wait(self) -> bool:
        """Block until an asynchronous save in flight is written (and committed on rank 0).

        Returns False when it failed (reported as :meth:`save` does).
        """
        return self.saver.wait()

    def restore_latest(self) -> int:
        """Load the newest complete checkpoint into the registered objects.

        Returns its step, or 0 when there is none. Every rank loads the same
        checkpoint: rank 0 verifies, chooses and tells the others. A checkpoint
        that fails verification is moved aside (``step_N.corrupt-<time>``) and
        the next older one is tried; when none is left, every rank raises
        :class:`NoUsableCheckpoint` (exit 2) rather than start from scratch.
        An in-memory snapshot newer than the newest checkpoint is loaded instead.

        A measured snapshot cadence (:mod:`.cadence`) starts measuring again from the step restored.
        """
        return self.restorer.restore_latest()

    def close(self) -> None:
        """Wait for a save in flight, release the writer lease (rank 0), then destroy the
        manager's gloo groups.

        Each gloo group holds three threads and a socket per peer until destroyed: a
        process that makes many managers (a sweep in one process, the conformance
        matrix) kept every one, 1,259 groups and 3,800 threads per rank after 180
        matrix rows. Destroying a subgroup is local (no collective); the manager
        makes no collective after close().
        """
        try:
            self.wait()
        finally:
            self.memory.close()
            self.saver.release_lease()
            for group in (self.ctx.group, self.ctx.writer_group):
                if group is not None and dist.is_initialized():
                    dist.destroy_process_group(group)
            self.ctx.group = self.ctx.writer_group = None

    # --- what callers read: each part's own state, under the names the manager always had ---
    directory = property(lambda self: self.ctx.directory, doc="Where checkpoints go (None: snapshots only).")
    fs = property(lambda self: self.ctx.fs, doc="The fsspec filesystem of a URL ``directory``; None when local.")
    storage_options = property(lambda self: self.ctx.storage_options, doc="fsspec options of a URL ``directory``.")
    rank = property(lambda self: self.ctx.rank, doc="This process's rank (0 in a single process).")
    world_size = property(lambda self: self.ctx.world_size, doc="Ranks when the manager was made.")
    group = property(lambda self: self.ctx.group, doc="The gloo group of the main thread's checkpoint collectives.")
    writer_group = property(lambda self: self.ctx.writer_group, doc="The gloo group of asynchronous saves.")
    every_steps = property(lambda self: self.settings.every_steps, doc="Save every this many steps (None: never).")
    every_s = property(lambda self: self.settings.every_s, doc="Save after this many seconds (None: never).")
    keep_last = property(lambda self: self.settings.keep_last, doc="Complete checkpoints kept.")
    async_save = property(lambda self: self.settings.async_save, doc="Write in a background thread.")
    verify = property(lambda self: self.settings.verify, doc="How a checkpoint is checked before loading.")
    max_failures = property(lambda self: self.settings.max_failures, doc="Failed saves in a row before exit 1.")
    preemption_deadline_s = property(lambda self: self.settings.preemption_deadline_s,
                                     doc="After SIGTERM, the process exits by this deadline.")
    stop_check_s = property(lambda self: self.schedule.stop_check_s, doc="How often ranks agree on a stop.")
    consecutive_failures = property(lambda self: self.saver.consecutive_failures, doc="Failed saves in a row.")
    last_save_failed = property(lambda self: self.saver.last_save_failed, doc="The latest save was not written.")
    blocking_s = property(lambda self: self.saver.blocking_s, doc="Seconds each save held the training loop.")
    lease = property(lambda self: self.saver.lease, doc="Rank 0's writer lease on ``directory`` (:mod:`.lease`).")
    last_saved_step = property(lambda self: self.ctx.last_saved_step,
                               doc="The newest step every rank agreed was written or restored (None: none).")
    snapshots = property(lambda self: self.memory.snapshots,
                         doc="The in-memory snapshots (:mod:`.snapshots`); None when none are kept.")
    device = property(lambda self: self.restorer.device, doc="Where per-rank GPU tensors are restored.")
    restored_from = property(lambda self: self.restorer.restored_from,
                             doc="What restore_latest() loaded: a checkpoint's directory or a snapshot.")
    restored_run = property(lambda self: self.restorer.restored_run,
                            doc="Rank 0: the run description in the checkpoint restored from disk.")
    _shared = property(lambda self: self.ctx.shared)  # the registry, as tests read it
    _per_rank = property(lambda self: self.ctx.per_rank)
    _committed = property(lambda self: self.saver.committed)  # rank 0: the in-flight commit and prune are over

    @property
    def preempt_requested(self) -> bool:
        """SIGTERM reached this rank (set by the handler; rank-local until :meth:`should_save` agrees)."""
        return self.ctx.preempt_requested

    @preempt_requested.setter
    def preempt_requested(self, value: bool) -> None:
        self.ctx.preempt_requested = value

    @property
    def describe_run(self) -> Callable[[], dict] | None:
        """What the run was, kept in each checkpoint's marker beside its step (plain JSON; see train/resume.py)."""
        return self.saver.describe_run

    @describe_run.setter
    def describe_run(self, describe: Callable[[], dict] | None) -> None:
        self.saver.describe_run = describe
