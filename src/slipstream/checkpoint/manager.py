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
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from .. import runtime
from ..errors import EXIT_PREEMPTED, ConfigError
from . import layout, safe_load

log = logging.getLogger("slipstream.checkpoint")


def _exit_now(code: int) -> None:
    log.error("preemption deadline passed before a checkpoint could be written; exiting with %d", code)
    os._exit(code)


class CheckpointManager:
    """Saves and restores registered objects together (see the module's example).

    ``device``: where per-rank tensors saved from a GPU are restored; default
    this rank's device (:func:`slipstream.checkpoint.safe_load.default_device`).
    Checkpoint files are read as plain data only: a file holding pickled
    objects is refused (:class:`~slipstream.checkpoint.safe_load.CheckpointRefused`).
    """

    def __init__(
        self,
        directory: str,
        *,
        every_steps: int | None = None,
        every_s: float | None = None,
        keep_last: int = 3,
        async_save: bool = False,
        handle_sigterm: bool = True,
        preemption_deadline_s: float = 25.0,
        device: torch.device | str | None = None,
    ) -> None:
        if not directory:
            raise ConfigError("checkpoint_dir must be a path, got an empty string")
        if every_steps is not None and every_steps < 1:
            raise ConfigError(f"checkpoint_every_steps must be >= 1, got {every_steps}")
        if every_s is not None and every_s <= 0:
            raise ConfigError(f"checkpoint_every_s must be > 0, got {every_s}")
        if preemption_deadline_s <= 0:
            raise ConfigError(f"preemption_deadline_s must be > 0, got {preemption_deadline_s}")
        if keep_last < 1:
            raise ConfigError(f"checkpoint_keep_last must be >= 1, got {keep_last}")
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ConfigError(f"checkpoint_dir exists and is not a directory: {directory}")
        self.directory = directory
        self.every_steps = every_steps
        self.every_s = every_s
        self.keep_last = keep_last
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
        if dist.is_initialized():
            self.group = dist.new_group(backend="gloo", timeout=runtime.group_timeout())
            self.writer_group = dist.new_group(backend="gloo", timeout=runtime.group_timeout()) if async_save else None
        else:
            self.group = self.writer_group = None
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
        self.last_saved_step: int | None = None
        self.blocking_s: list[float] = []  # time each save held the training loop
        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    # --- registry ----------------------------------------------------------------------
    def register(self, name: str, obj: Any, per_rank: bool = False) -> None:
        """Save and restore ``obj`` (anything with state_dict()/load_state_dict())."""
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(f"checkpoint state {name!r} needs state_dict() and load_state_dict()")
        if name in self._shared or name in self._per_rank:
            raise ConfigError(f"checkpoint state {name!r} is registered twice")
        (self._per_rank if per_rank else self._shared)[name] = obj

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
        """(save now, preempted): agreed by all ranks through one tiny all-reduce."""
        due = self.every_steps is not None and step % self.every_steps == 0
        timed = self.every_s is not None and time.monotonic() - self._last_save_time >= self.every_s
        flags = torch.tensor([int(due or timed), int(self.preempt_requested)], dtype=torch.int32)
        if self.group is not None and self.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0] or flags[1]), bool(flags[1])

    def maybe_save(self, step: int) -> bool:
        """Save when due; returns True when the job was preempted (and saved)."""
        save, preempted = self.should_save(step)
        if save:
            self.save(step, blocking=preempted)
        return preempted

    def save(self, step: int, blocking: bool = False) -> None:
        """Write a checkpoint of ``step`` (asynchronously when configured and not ``blocking``)."""
        started = time.perf_counter()
        self.wait()
        partial = layout.step_dir(self.directory, step, partial=True)
        final = layout.step_dir(self.directory, step)
        if self.rank == 0:
            os.makedirs(partial, exist_ok=True)
        self._barrier()
        if self._per_rank:
            per_rank = {name: obj.state_dict() for name, obj in self._per_rank.items()}
            tmp = os.path.join(partial, f"rank{self.rank}.pt.tmp")
            torch.save(per_rank, tmp)
            os.replace(tmp, os.path.join(partial, f"rank{self.rank}.pt"))
        info = {"step": step, "world_size": self.world_size}
        if self.async_save and not blocking:
            future = dcp.async_save(dict(self._shared), checkpoint_id=partial, process_group=self.writer_group)
            self._pending, self._pending_step = future, step
            if self.rank == 0:
                self._committed.clear()
                future.add_done_callback(lambda f: self._finish(f, partial, final, info))
        else:
            dcp.save(dict(self._shared), checkpoint_id=partial, process_group=self.group)
            # dcp.save returns on the coordinator only after every rank's data is
            # written (it gathers their results before writing .metadata).
            if self.rank == 0:
                self._commit(partial, final, info)
            self._barrier()
            self.last_saved_step = step
        self._last_save_time = time.monotonic()
        self.blocking_s.append(time.perf_counter() - started)

    def _finish(self, future: Future, partial: str, final: str, info: dict) -> None:
        try:
            if future.exception() is not None:
                log.error("asynchronous checkpoint of step %s failed: %s", info["step"], future.exception())
                return
            self._commit(partial, final, info)
        finally:
            self._committed.set()

    def _commit(self, partial: str, final: str, info: dict) -> None:
        layout.commit(partial, final, info)
        layout.prune(self.directory, self.keep_last, in_flight_step=None)
        self.last_saved_step = info["step"]

    def wait(self) -> None:
        """Block until an asynchronous save in flight is written (and committed on rank 0)."""
        if self._pending is not None:
            self._pending.result()
            if self.rank == 0 and not self._committed.wait(timeout=60):
                # add_done_callback runs the commit and then the prune in the writer
                # thread. Waiting for the rename alone was not enough: the prune, still
                # running, deleted the next save's step_N.partial as debris (seen in CI).
                log.warning("asynchronous checkpoint of step %s: commit still running after 60 s",
                            self._pending_step)
            self.last_saved_step = self._pending_step
            self._pending = self._pending_step = None
            self._barrier()

    def _barrier(self) -> None:
        if self.group is not None and self.world_size > 1:
            dist.barrier(group=self.group)

    # --- restoring -----------------------------------------------------------------------
    def restore_latest(self) -> int:
        """Load the newest complete checkpoint into the registered objects.

        Returns its step, or 0 when there is none. Every rank loads the same
        checkpoint: rank 0 chooses and tells the others.
        """
        choice = [None]
        if self.rank == 0:
            latest = layout.find_latest(self.directory)
            choice[0] = (latest.path, latest.step, latest.info.get("world_size")) if latest else None
        if self.group is not None and self.world_size > 1:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        if choice[0] is None:
            return 0
        path, step, saved_world = choice[0]
        # DCP copies every tensor into the registered one, on that tensor's device; its
        # non-tensor values (counters, scaler and scheduler state) and its metadata are
        # read as plain data, not as arbitrary pickles.
        safe_load.dcp_load(dict(self._shared), path, process_group=self.group)
        rank_file = os.path.join(path, f"rank{self.rank}.pt")
        if self._per_rank:
            if os.path.exists(rank_file):
                per_rank = safe_load.load_rank_file(rank_file, self.device)
                for name, obj in self._per_rank.items():
                    if name in per_rank:
                        obj.load_state_dict(per_rank[name])
            else:
                log.warning(
                    "checkpoint %s was written by %s rank(s); rank %d has no per-rank state there "
                    "(RNG streams and gradient-sync buffers start fresh)", path, saved_world, self.rank
                )
        self.last_saved_step = step
        self._last_save_time = time.monotonic()
        return step

    def close(self) -> None:
        self.wait()
