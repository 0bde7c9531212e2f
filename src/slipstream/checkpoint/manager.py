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
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from .. import heal, runtime
from ..errors import EXIT_PREEMPTED, ConfigError
from ..log import CONSOLE
from . import layout, lease, peer, remote, safe_load, snapshots, storage
from . import verify as integrity  # the name `verify` is the constructor's option

log = logging.getLogger("slipstream.checkpoint")

# The most steps between two agreements of the stop flag and the save clock (1 ms steps: a stop seen 0.1 s later).
STOP_CHECK_MAX_STEPS = 100


class NoUsableCheckpoint(ConfigError):
    """The checkpoint directory held checkpoints, and none of them verifies (exit 2)."""


def _exit_now(code: int) -> None:
    log.error("preemption deadline passed before a checkpoint could be written; exiting with %d", code)
    os._exit(code)


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
        if directory == "":
            raise ConfigError("checkpoint_dir must be a path, got an empty string")
        if directory is None and snapshot_every_steps is None and not snapshot_auto:
            raise ConfigError("a checkpoint manager without a directory keeps in-memory snapshots only: "
                              "give snapshot_every_steps or snapshot_auto")
        if every_steps is not None and every_steps < 1:
            raise ConfigError(f"checkpoint_every_steps must be >= 1, got {every_steps}")
        if every_s is not None and every_s <= 0:
            raise ConfigError(f"checkpoint_every_s must be > 0, got {every_s}")
        if preemption_deadline_s <= 0:
            raise ConfigError(f"preemption_deadline_s must be > 0, got {preemption_deadline_s}")
        if not 0 < stop_check_s < preemption_deadline_s:
            raise ConfigError(f"stop_check_s must be > 0 and below preemption_deadline_s ({preemption_deadline_s}), "
                              f"got {stop_check_s:g}")
        if keep_last < 1:
            raise ConfigError(f"checkpoint_keep_last must be >= 1, got {keep_last}")
        if verify not in integrity.VERIFY_MODES:
            raise ConfigError(f"checkpoint_verify must be one of {', '.join(integrity.VERIFY_MODES)}, got {verify!r}")
        if max_failures < 1:
            raise ConfigError(f"checkpoint_max_failures must be >= 1, got {max_failures}")
        if snapshot_every_steps is not None and snapshot_every_steps < 1:
            raise ConfigError(f"snapshot_every_steps must be >= 1 or None, got {snapshot_every_steps}")
        directory = remote.local_path(directory) if directory is not None else None
        # An object store (a URL): the filesystem, made on every rank alike (a missing
        # fsspec is the same ConfigError everywhere); None for a local directory.
        self.fs = remote.filesystem(directory, storage_options) if directory and remote.is_url(directory) else None
        self.storage_options = dict(storage_options or {})
        handle_sigterm = handle_sigterm and directory is not None  # none: nothing to write at a preemption
        if directory is not None and self.fs is None and os.path.exists(directory) and not os.path.isdir(directory):
            raise ConfigError(f"checkpoint_dir exists and is not a directory: {directory}")
        self.directory = directory
        self.every_steps = every_steps
        self.every_s = every_s
        self.keep_last = keep_last
        self.verify = verify
        self.max_failures = max_failures
        self.consecutive_failures = 0
        self.last_save_failed = False  # the latest save (or emergency save) was not written
        self._space_checked = False  # rank 0: keep_last x size vs free space, once per run
        self._commit_error: BaseException | None = None  # rank 0: an asynchronous commit that failed
        self.async_save = async_save
        # Where per-rank tensors saved from a GPU (error-feedback buffers) come back:
        # this rank's GPU, whichever index it had when saved. CPU tensors (RNG states)
        # stay on the CPU. None: this rank's device, looked up when a GPU tensor turns up.
        self.device = torch.device(device) if device is not None else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # Checkpoint collectives get their own gloo groups, so they stay on the
        # CPU whatever the training backend: `group` for the main thread (flag
        # exchange, barriers, synchronous saves, loads) and `writer_group` for
        # asynchronous saves, whose collectives run in a background thread and
        # must never interleave with the main thread's on one group.
        # Both carry the run's collective timeout: a peer lost in a save or a load
        # fails the survivors as soon as a lost training collective would.
        self.group = self.writer_group = None
        if dist.is_initialized():
            self._make_groups(async_save)
        self._shared: dict[str, Stateful] = {}
        self._per_rank: dict[str, Stateful] = {}
        self._pending: Future | None = None
        self._pending_step: int | None = None
        # Rank 0: set when the in-flight save's commit *and* prune are over (see wait()).
        self._committed = threading.Event()
        self._committed.set()
        self._last_save_time = time.monotonic()
        self.preempt_requested = False
        self.preemption_deadline_s = preemption_deadline_s
        self.stop_check_s = stop_check_s
        # should_save's agreements: the step of the last one (None: none yet), the next step
        # that agrees (both the same on every rank), and when this rank left the last one.
        self._agreed_step: int | None = None
        self._next_agreement_step = 0
        self._agreed_at = time.monotonic()
        # The newest step every rank agreed was written (or restored): set only after an
        # agreement, so a branch before a collective may read it (save_final does).
        self.last_saved_step: int | None = None
        self.blocking_s: list[float] = []  # time each save held the training loop
        if self.rank == 0 and self.fs is None and directory is not None:
            os.makedirs(directory, exist_ok=True)
        # Before any write, and agreed by all ranks (a refusal raises on every rank).
        # A replacement healing in place decides alone (its group is the fake one until it joins).
        agree_on = None if heal.on_fake_group() else self.group
        self.lease = None if directory is None else lease.take_for_job(
            directory, rank=self.rank, world_size=self.world_size, group=agree_on, interval_s=lease_interval_s,
            stale_after_s=lease_stale_after_s, storage_options=storage_options)
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._said_cadence: object = None  # rank 0: the cadence line printed last (cadence.Choice)
        self.snapshots = self._open_snapshots(snapshot_every_steps, snapshot_auto, snapshot_peer_copy)
        self.restored_from: str | None = None  # what restore_latest() loaded: a checkpoint's path or a snapshot
        # What the run was, kept in each checkpoint's marker beside its step (plain JSON; see
        # train/resume.py), and rank 0's copy of the one restore_latest() loaded from disk.
        self.describe_run: Callable[[], dict] | None = None
        self.restored_run: dict | None = None
        # For objects registered after the restore (register(..., late=True)): where their state is.
        self._restored_path: str | None = None
        self._restored_unclaimed: dict[str, Any] = {}  # a snapshot's entries no object was registered for

    def _make_groups(self, async_save: bool) -> None:
        # A replacement healing in place (slipstream.heal) runs on a fake default group until it
        # joins the survivors: its side groups are fake too until then (see rejoined()).
        backend = heal.side_group_backend()
        self.group = dist.new_group(backend=backend, timeout=runtime.group_timeout())
        self.writer_group = dist.new_group(backend=backend, timeout=runtime.group_timeout()) if async_save else None

    def left(self) -> None:
        """Healing in place, before the broken default group is destroyed: drop every reference to
        this manager's groups (they are destroyed with it), so their sockets close."""
        self.group = self.writer_group = None
        if self.snapshots is not None and self.snapshots.peer is not None:
            self.snapshots.peer.left()  # its group went with the default group too

    def rejoined(self) -> None:
        """After a heal in place (:mod:`slipstream.heal`): new side groups (a collective, every rank in
        one order). A save in flight is let go: it commits only if every rank's part was written."""
        self._pending = self._pending_step = None
        self._committed.set()
        self._agreed_step, self._next_agreement_step, self._agreed_at = None, 0, time.monotonic()  # as a new manager's
        self._make_groups(self.async_save)
        if self.snapshots is not None:
            self.snapshots.mark_restarted()
            if self._peer_copy_wanted:  # a new copy on the new group (a collective, as at the start)
                self.snapshots.peer = peer.PeerCopy.for_job(self.rank, self.group, self.snapshots.peer_slots)

    def _open_snapshots(self, every_steps: int | None, auto: bool,
                        peer_copy: bool) -> snapshots.MemorySnapshots | None:
        """In-memory snapshots (every ``every_steps``, or ``auto``: :mod:`.cadence`) when an elastic agent
        would restart a failed worker to use them; ``peer_copy``: also on another node (:mod:`.peer`)."""
        self._peer_copy_wanted = False
        if every_steps is None and not auto:
            return None
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            if self.rank == 0:
                log.warning("snapshot_every_steps is set but no elastic agent (slipstream run, torchrun) started "
                            "this process to restart it: no in-memory snapshots")
            return None
        snaps = snapshots.MemorySnapshots.for_run(self.directory, self.rank, self.world_size, every_steps)
        self._peer_copy_wanted = peer_copy and self.group is not None and self.world_size > 1
        # A replacement healing in place makes its copy in rejoined(): its default group is fake until then.
        if self._peer_copy_wanted and not heal.on_fake_group():
            snaps.peer = peer.PeerCopy.for_job(self.rank, self.group, snaps.peer_slots)
        return snaps

    def maybe_snapshot(self, step: int) -> bool:
        """Snapshot ``step`` in host memory when due (True: taken). Call it at every optimizer step on
        every rank: a measured cadence (:mod:`.cadence`) times the steps and agrees once (a collective)."""
        if self.snapshots is None:
            return False
        many = self.group is not None and self.world_size > 1
        took, choice = self.snapshots.on_step(step, self._shared, self._per_rank, self._agree_cadence if many else None)
        if choice is not None and self.rank == 0 and choice != self._said_cadence:
            self._said_cadence = choice
            log.info(choice.line(), extra=CONSOLE)
        return took

    def _agree_cadence(self, stall_s: float, step_s: float) -> tuple[float, float]:
        """(the largest stall, the smallest step time) of every rank: one all-reduce."""
        values = torch.tensor([stall_s, -step_s], dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return float(values[0]), -float(values[1])

    # --- registry ----------------------------------------------------------------------
    def register(self, name: str, obj: Any, per_rank: bool = False) -> None:
        """Save and restore ``obj`` (anything with state_dict()/load_state_dict())."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(f"checkpoint state {name!r} needs state_dict() and load_state_dict()")
        if name in self._shared or name in self._per_rank:
            raise ConfigError(f"checkpoint state {name!r} is registered twice")
        (self._per_rank if per_rank else self._shared)[name] = obj

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
        if name in self._restored_unclaimed:
            snapshots.MemorySnapshots.apply({"shared": {name: self._restored_unclaimed.pop(name)}, "per_rank": {}},
                                            {name: obj}, {})
            return True
        if self._restored_path is None:
            return False
        metadata = safe_load.check_dcp_metadata(self._restored_path, self.fs)
        held = any(key == name or key.startswith(name + ".") for key in metadata.state_dict_metadata)
        if held:
            reader = remote.dcp_reader(self._restored_path, self.storage_options) if self.fs is not None else None
            safe_load.dcp_load({name: obj}, self._restored_path, process_group=self.group, storage_reader=reader,
                               fs=self.fs)
        return held

    # --- saving ------------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        # Only a flag: the save happens at the next step boundary, together with
        # every other rank (a checkpoint is a collective). A rank that never
        # reaches a boundary (stuck, or its peers are gone) still exits by the
        # deadline, before the agent or the kubelet resorts to SIGKILL.
        if self.preempt_requested:
            return
        self.preempt_requested = True
        timer = threading.Timer(self.preemption_deadline_s, _exit_now, args=(EXIT_PREEMPTED,))
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
        if self.directory is None:  # in-memory snapshots only: nothing to save, no stop request to agree on
            return False, False
        due = self.every_steps is not None and step % self.every_steps == 0
        if self.group is None or self.world_size == 1:
            timed = self.every_s is not None and time.monotonic() - self._last_save_time >= self.every_s
            return due or timed or self.preempt_requested, self.preempt_requested
        between = self._agreed_step is not None and self._agreed_step < step < self._next_agreement_step
        if between and not due:
            return False, False
        now = time.monotonic()
        timed = self.every_s is not None and now - self._last_save_time >= self.every_s
        # This rank's mean step time since the last agreement (none yet: as if one step took
        # stop_check_s, so the next step agrees again and measures).
        gap = step - self._agreed_step if self._agreed_step is not None and step > self._agreed_step else 0
        step_s = (now - self._agreed_at) / gap if gap else self.stop_check_s
        flags = torch.tensor([float(timed), float(self.preempt_requested), step_s], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        save, preempted, slowest_s = bool(flags[0]) or due, bool(flags[1]), float(flags[2])
        ahead = int(self.stop_check_s / slowest_s) if slowest_s > 0 else STOP_CHECK_MAX_STEPS
        self._agreed_step, self._agreed_at = step, time.monotonic()
        self._next_agreement_step = step + max(1, min(STOP_CHECK_MAX_STEPS, ahead))
        return save or preempted, preempted

    def maybe_save(self, step: int) -> bool:
        """Save when due; returns True when the job was preempted (and saved)."""
        save, preempted = self.should_save(step)
        if save:
            self.save(step, blocking=preempted)
        return preempted

    def save(self, step: int, blocking: bool = False) -> bool:
        """Write a checkpoint of ``step`` (asynchronously when configured and not ``blocking``).

        Returns False when it failed (reported, see :meth:`_save_failed`); an
        asynchronous save's outcome is known at the next :meth:`wait`. Every
        phase ends with all ranks agreeing on success, so a rank whose write
        failed and one whose write succeeded reach the same collectives.
        """
        if self.directory is None:
            raise ConfigError("this checkpoint manager keeps in-memory snapshots only (no checkpoint_dir)")
        started = time.perf_counter()
        self.wait()
        self._check_lease()
        partial = self._write_dir(step)  # an object store has no rename: its files go to step_N/ at once
        final = layout.step_dir(self.directory, step)
        error: BaseException | None = None
        if self.rank == 0:
            try:
                if self.fs is None:
                    os.makedirs(partial, exist_ok=True)
                else:  # debris of an earlier attempt at this step (or its checkpoint, re-saved): marker first
                    layout.remove(final, self.fs)
            except storage.SAVE_ERRORS as exc:
                error = exc
        ok = self._agree(error, step, partial)  # also the barrier: the directory exists for every rank
        if ok and self._per_rank:
            tmp = os.path.join(partial, f"rank{self.rank}.pt" if self.fs else f"rank{self.rank}.pt.tmp")
            try:
                per_rank = {name: obj.state_dict() for name, obj in self._per_rank.items()}
                if self.fs is None:
                    torch.save(per_rank, tmp)
                    os.replace(tmp, os.path.join(partial, f"rank{self.rank}.pt"))
                else:  # one put of the whole object: it exists complete or not at all
                    buffer = io.BytesIO()
                    torch.save(per_rank, buffer)
                    self.fs.pipe_file(tmp, buffer.getvalue())
            except storage.SAVE_ERRORS as exc:
                error = exc
            ok = self._agree(error, step, partial, where=tmp)  # torch.save's errors do not name the file
        info = {"step": step, "world_size": self.world_size}
        if self.describe_run is not None:
            info["run"] = self.describe_run()
        if ok and self.async_save and not blocking:
            future = dcp.async_save(dict(self._shared), **self._dcp_target(partial), process_group=self.writer_group)
            self._pending, self._pending_step = future, step
            if self.rank == 0:
                self._committed.clear()
                self._commit_error = None
                future.add_done_callback(lambda f: self._finish(f, partial, final, info))
        elif ok:
            try:
                # DCP raises on every rank when any rank's write failed; it returns on the
                # coordinator only after every rank's data is written (it gathers their
                # results before writing .metadata).
                dcp.save(dict(self._shared), **self._dcp_target(partial), process_group=self.group)
                if self.rank == 0:
                    self._commit(partial, final, info)
            except storage.SAVE_ERRORS as exc:
                error = exc
            ok = self._agree(error, step, partial)
            if ok:
                self._saved(step)
        self._last_save_time = time.monotonic()
        self.blocking_s.append(time.perf_counter() - started)
        return ok

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
        ok = self.wait()
        if step > 0 and self.last_saved_step != step and self.directory is not None:
            ok = self.save(step, blocking=True)
        return ok

    def _write_dir(self, step: int) -> str:
        """Where the files of ``step`` are written: ``step_N.partial`` locally, ``step_N/`` in an object store."""
        return layout.step_dir(self.directory, step, partial=self.fs is None)

    def _dcp_target(self, path: str) -> dict:
        """DCP's destination: a local path as today; in an object store its fsspec writer
        (with ``storage_options``; ``checkpoint_id`` alone would drop them)."""
        if self.fs is None:
            return {"checkpoint_id": path}
        return {"storage_writer": remote.dcp_writer(path, self.storage_options)}

    def _finish(self, future: Future, partial: str, final: str, info: dict) -> None:
        # The writer thread, rank 0 only. A failure is kept for wait(), where all ranks agree on it.
        try:
            if future.exception() is None:
                self._commit(partial, final, info)
        except storage.SAVE_ERRORS as exc:
            self._commit_error = exc
        finally:
            self._committed.set()

    def _check_lease(self) -> None:
        """Every rank stops writing once rank 0's heartbeat found its lease taken over
        (another job writes here now): one small all-reduce per save."""
        lost = torch.tensor([int(self.lease is not None and self.lease.lost)], dtype=torch.int32)
        if self.group is not None and self.world_size > 1:
            dist.all_reduce(lost, op=dist.ReduceOp.MAX, group=self.group)
        if lost.item():
            raise lease.CheckpointDirInUse(
                f"checkpoint_dir {self.directory}: another job took over its writer lease (rank 0's log names it); "
                "this job writes no more checkpoints there"
            )

    def _commit(self, partial: str, final: str, info: dict) -> None:
        # Rank 0 reads every file back for its checksum (about 2 GB/s from the page cache:
        # +30% on a synchronous save of 269 MB here, docs/fault-tolerance.md), in the writer
        # thread when async. checkpoint_verify=size or off records sizes only, skipping that.
        files = integrity.describe_files(partial, checksums=self.verify == "full", fs=self.fs)
        if self.fs is None:
            layout.commit(partial, final, {**info, "files": files})
        else:
            # The marker is the commit: put it only once DCP's .metadata (written by the
            # coordinator after every rank's shards) and every rank's file are there.
            expected = [".metadata"] + ([f"rank{r}.pt" for r in range(self.world_size)] if self._per_rank else [])
            missing = [name for name in expected if name not in files]
            if missing:
                raise FileNotFoundError(f"{final}: {', '.join(missing)} not found after the write; not committed")
            layout.commit_marker(final, {**info, "files": files}, self.fs)
        layout.prune(self.directory, self.keep_last, in_flight_step=None, fs=self.fs)
        # Not last_saved_step: this runs on rank 0 alone (in the writer thread when async);
        # last_saved_step is set on every rank once they agreed the save was written (_saved).
        if self.fs is None:  # free space is a local notion; an object store has none to check
            self._check_space(sum(entry["bytes"] for entry in files.values()))

    def _check_space(self, one_checkpoint: int) -> None:
        if not self._space_checked:  # once per run, after the first commit: its size is known now
            self._space_checked = True
            warning = storage.space_warning(self.directory, self.keep_last, one_checkpoint)
            if warning:
                log.warning("%s", warning)

    def wait(self) -> bool:
        """Block until an asynchronous save in flight is written (and committed on rank 0).

        Returns False when it failed (reported as :meth:`save` does).
        """
        if self._pending is None:
            return True
        step, error = self._pending_step, None
        try:
            self._pending.result()
        except storage.SAVE_ERRORS as exc:
            error = exc
        if self.rank == 0:
            if not self._committed.wait(timeout=60):
                # add_done_callback runs the commit and then the prune in the writer
                # thread. Waiting for the rename alone was not enough: the prune, still
                # running, deleted the next save's step_N.partial as debris (seen in CI).
                log.warning("asynchronous checkpoint of step %s: commit still running after 60 s", step)
            error = error or self._commit_error
        self._pending = self._pending_step = None
        ok = self._agree(error, step, self._write_dir(step))
        if ok:
            self._saved(step)
        return ok

    def _saved(self, step: int) -> None:
        self.last_saved_step = step
        self.consecutive_failures = 0
        self.last_save_failed = False

    def _agree(self, error: BaseException | None, step: int, partial: str, where: str | None = None) -> bool:
        """All ranks learn whether any rank failed (one all-reduce); on failure, every
        rank also gets the first failing rank's description and follows the policy."""
        flag = torch.tensor([int(error is not None)], dtype=torch.int32)
        many = self.group is not None and self.world_size > 1
        if many:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if not flag.item():
            return True
        description = None
        if error is not None:
            try:
                description = self._describe(error, where or partial)
            except Exception as exc:  # noqa: BLE001 - describing must not break the agreement (a hang)
                description = f"{type(error).__name__}: {error} writing {where or partial} ({exc} while describing it)"
        if many:
            gathered: list = [None] * self.world_size
            dist.all_gather_object(gathered, (self.rank, description), group=self.group)
            rank, description = next(item for item in gathered if item[1] is not None)
            if rank and not description.startswith("rank "):
                description = f"rank {rank}: {description}"
        self._save_failed(step, partial, description)  # type: ignore[arg-type]  (some rank failed: not None)
        return False

    def _describe(self, error: BaseException, partial: str) -> str:
        latest = layout.find_latest(self.directory, self.fs)
        size = source = None
        if latest is not None:
            try:
                size, source = integrity.checkpoint_bytes(latest.info), f", from {os.path.basename(latest.path)}'s marker"
            except (OSError, ValueError):
                pass
        if size is None and self.world_size == 1:
            # One rank only: on a sharded layout state_dict() may be collective, and only
            # the failing rank describes the failure (a hang). Several ranks: "unknown".
            size = sum(storage.state_bytes(obj.state_dict()) for obj in self._shared.values())
            source = ", estimated from the state's tensors"
        return storage.describe_failure(error, partial, size, source or "")

    def _save_failed(self, step: int, partial: str, description: str) -> None:
        """The policy: warn loudly and keep training (the next interval retries), until
        ``max_failures`` saves in a row failed; then exit 1 (CheckpointSaveFailed)."""
        self.consecutive_failures += 1
        self.last_save_failed = True
        if self.rank == 0:  # every rank is past its writes: the agreement said so
            if self.fs is None:
                shutil.rmtree(partial, ignore_errors=True)
            else:
                try:
                    layout.discard_unmarked(partial, self.fs)
                except Exception as exc:  # noqa: BLE001 - debris: the next prune retries
                    log.warning("checkpoint_dir %s: %s not deleted (%s); the next prune retries", self.directory, partial, exc)
        latest = layout.find_latest(self.directory, self.fs)
        kept = f"{os.path.basename(latest.path)} is intact" if latest else "no earlier checkpoint exists"
        what = "emergency checkpoint (SIGTERM)" if self.preempt_requested else "checkpoint"
        message = f"{what} of step {step} not written: {description}; {kept}"
        if self.consecutive_failures >= self.max_failures:
            raise storage.CheckpointSaveFailed(
                f"{message}; giving up after {self.consecutive_failures} failed saves in a row "
                f"(checkpoint_max_failures={self.max_failures})"
            )
        if self.rank == 0:
            log.error(
                "%s; training continues and retries at the next save (failure %d of checkpoint_max_failures=%d)",
                message, self.consecutive_failures, self.max_failures,
            )

    def _barrier(self) -> None:
        if self.group is not None and self.world_size > 1:
            dist.barrier(group=self.group)

    # --- restoring -----------------------------------------------------------------------
    def restore_latest(self) -> int:
        """Load the newest complete checkpoint into the registered objects.

        Returns its step, or 0 when there is none. Every rank loads the same
        checkpoint: rank 0 verifies, chooses and tells the others. A checkpoint
        that fails verification is moved aside (``step_N.corrupt-<time>``) and
        the next older one is tried; when none is left, every rank raises
        :class:`NoUsableCheckpoint` (exit 2) rather than start from scratch.

        A measured snapshot cadence (:mod:`.cadence`) starts measuring again from the step restored.
        """
        step = self._restore_latest()
        if self.snapshots is not None:
            self.snapshots.cadence.restart(step)
        return step

    def _restore_latest(self) -> int:
        snapshot = self.snapshots.agreed_newest(self.group) if self.snapshots is not None else None
        if snapshot is not None:
            newest: list = [0 if self.directory is None else None]
            if self.rank == 0 and self.directory is not None:
                try:
                    latest = layout.find_latest(self.directory, self.fs)
                    newest[0] = latest.step if latest is not None else 0
                except Exception:  # noqa: BLE001 - a store that cannot be listed: the snapshot is the newest known
                    newest[0] = 0
            if self.group is not None and self.world_size > 1 and self.directory is not None:
                dist.broadcast_object_list(newest, src=0, group=self.group)
            if snapshot >= newest[0] and self._restore_snapshot(snapshot):
                via = "".join(f"rank {r} from its peer copy on rank {h}; "
                              for r, h in sorted(self.snapshots.from_peers.items()))
                disk = ("no checkpoint_dir" if self.directory is None else
                        f"newest checkpoint in {self.directory}: {f'step {newest[0]}' if newest[0] else 'none'}")
                self.restored_from = f"an in-memory snapshot ({via}{disk})"
                self._last_save_time = time.monotonic()
                return snapshot
        if self.directory is None:  # no disk to fall back to
            return 0
        choice: list = [None]
        if self.rank == 0:
            try:
                choice[0] = integrity.choose_newest(self.directory, self.verify, self.fs)
            except Exception as exc:  # noqa: BLE001 - told to every rank below, not raised here alone (a hang)
                choice[0] = f"checkpoint_dir {self.directory} cannot be searched for checkpoints: {exc}"
        if self.group is not None and self.world_size > 1:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        if choice[0] is None:
            return 0
        if isinstance(choice[0], str):
            raise NoUsableCheckpoint(choice[0])
        path, step, saved_world = choice[0]
        # This rank's own file is read (and refused) before the collective load, and the
        # outcome agreed: a rank refusing alone would leave the others in DCP's load.
        per_rank, refusal = self._read_rank_file(path)
        safe_load.agree_refusal(refusal, self.group)
        # DCP copies every tensor into the registered one, on that tensor's device; its
        # non-tensor values (counters, scaler and scheduler state) and its metadata are
        # read as plain data, not as arbitrary pickles (refusals agreed there too).
        reader = remote.dcp_reader(path, self.storage_options) if self.fs is not None else None
        safe_load.dcp_load(dict(self._shared), path, process_group=self.group, storage_reader=reader, fs=self.fs)
        if per_rank is not None:
            for name, obj in self._per_rank.items():
                if name in per_rank:
                    obj.load_state_dict(per_rank[name])
        elif self._per_rank:
            log.warning(
                "checkpoint %s was written by %s rank(s); rank %d has no per-rank state there "
                "(RNG streams and gradient-sync buffers start fresh)", path, saved_world, self.rank
            )
        self.last_saved_step = step
        self._last_save_time = time.monotonic()
        self.restored_from = self.directory
        self._restored_path = path
        if self.rank == 0:
            try:
                self.restored_run = layout.CheckpointDir(path, step, self.fs).info.get("run")
            except (OSError, ValueError):  # verified a moment ago; a marker gone now only loses the comparison
                self.restored_run = None
        return step

    def _restore_snapshot(self, step: int) -> bool:
        """Load every rank's snapshot of ``step``, or none (False, every rank alike: then the
        disk checkpoint is loaded). Each rank reads its own first and the ranks agree before
        any registered object changes, so a rank that cannot read leaves no rank half-restored."""
        tree, problem = None, ""
        try:
            tree = self.snapshots.read(step, self.group)  # type: ignore[union-attr]  (peer copies: a collective)
        except Exception as exc:  # noqa: BLE001 - agreed below; the disk checkpoint is the fallback
            problem = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        failed = torch.tensor([0.0 if tree is not None else 1.0])
        if self.group is not None and self.world_size > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if failed.item():
            if problem:
                log.warning("the in-memory snapshot of step %d cannot be read (%s): loading the newest "
                            "checkpoint on disk instead", step, problem)
            return False
        self.snapshots.apply(tree, self._shared, self._per_rank)  # type: ignore[union-attr, arg-type]
        self._restored_unclaimed = {name: state for name, state in tree["shared"].items() if name not in self._shared}
        self._restored_path = None
        return True

    def _read_rank_file(self, path: str) -> tuple[dict | None, Exception | None]:
        """(this rank's per-rank state in checkpoint ``path`` or None when it has no file
        there, the error when the file cannot be used): never raises, so that every
        rank reaches the agreement (:func:`~.safe_load.agree_refusal`)."""
        if not self._per_rank:
            return None, None
        rank_file = os.path.join(path, f"rank{self.rank}.pt")
        try:
            data = self._read_object(rank_file) if self.fs is not None else None
            if not (os.path.exists(rank_file) if self.fs is None else data is not None):
                return None, None
            return safe_load.load_rank_file(rank_file, self.device, data=data), None
        except safe_load.CheckpointRefused as exc:
            return None, exc
        except Exception as exc:  # noqa: BLE001 - an object store's read error: agreed, not raised alone (a hang)
            return None, OSError(f"checkpoint file {rank_file} cannot be read: {type(exc).__name__}: {exc}")

    def _read_object(self, url: str) -> bytes | None:
        try:
            return self.fs.cat_file(url)
        except FileNotFoundError:
            return None

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
            if self.snapshots is not None and self.snapshots.peer is not None:
                self.snapshots.peer.close()
            if self.lease is not None:
                self.lease.release()
                self.lease = None
            for group in (self.group, self.writer_group):
                if group is not None and dist.is_initialized():
                    dist.destroy_process_group(group)
            self.group = self.writer_group = None
