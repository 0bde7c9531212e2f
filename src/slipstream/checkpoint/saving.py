"""The save path of a :class:`~slipstream.checkpoint.manager.CheckpointManager`.

:class:`Saver` writes a checkpoint (synchronously, or with DCP's asynchronous save and a
commit in the writer thread), commits it (:mod:`.layout`), prunes to ``keep_last``, and
turns a failed write into the failure policy (:mod:`.storage`). Every phase ends with all
ranks agreeing on success, so a rank whose write failed and one whose write succeeded
reach the same collectives.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..errors import ConfigError
from . import layout, lease, remote, storage
from . import verify as integrity
from .context import ManagerContext

log = logging.getLogger("slipstream.checkpoint")


class Saver:
    """Writes, commits and prunes checkpoints, and keeps the failure count.

    ``writer_lease``: rank 0's lease on the directory (:mod:`.lease`; None on other ranks'
    side of it, and with no directory); a save stops once it is lost.
    """

    def __init__(self, ctx: ManagerContext, writer_lease: lease.Lease | None) -> None:
        self.ctx = ctx
        self.lease = writer_lease
        self.consecutive_failures = 0
        self.last_save_failed = False  # the latest save (or emergency save) was not written
        self.blocking_s: list[float] = []  # time each save held the training loop
        # What the run was, kept in each checkpoint's marker beside its step (plain JSON; see train/resume.py).
        self.describe_run: Callable[[], dict] | None = None
        self._space_checked = False  # rank 0: keep_last x size vs free space, once per run
        self._commit_error: BaseException | None = None  # rank 0: an asynchronous commit that failed
        self._pending: Future | None = None
        self._pending_step: int | None = None
        # Rank 0: set when the in-flight save's commit *and* prune are over (see wait()).
        self.committed = threading.Event()
        self.committed.set()

    def let_go(self) -> None:
        """A heal in place: a save in flight is let go (it commits only if every rank's part was written)."""
        self._pending = self._pending_step = None
        self.committed.set()

    def release_lease(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def save(self, step: int, blocking: bool = False) -> bool:
        """See :meth:`slipstream.checkpoint.manager.CheckpointManager.save`."""
        ctx = self.ctx
        if ctx.directory is None:
            raise ConfigError("this checkpoint manager keeps in-memory snapshots only (no checkpoint_dir)")
        started = time.perf_counter()
        self.wait()
        self._check_lease()
        partial = self._write_dir(step)  # an object store has no rename: its files go to step_N/ at once
        final = layout.step_dir(ctx.directory, step)
        error: BaseException | None = None
        if ctx.rank == 0:
            try:
                if ctx.fs is None:
                    os.makedirs(partial, exist_ok=True)
                else:  # debris of an earlier attempt at this step (or its checkpoint, re-saved): marker first
                    layout.remove(final, ctx.fs)
            except storage.SAVE_ERRORS as exc:
                error = exc
        ok = self._agree(error, step, partial)  # also the barrier: the directory exists for every rank
        if ok and ctx.per_rank:
            tmp = os.path.join(partial, f"rank{ctx.rank}.pt" if ctx.fs else f"rank{ctx.rank}.pt.tmp")
            try:
                per_rank = {name: obj.state_dict() for name, obj in ctx.per_rank.items()}
                if ctx.fs is None:
                    torch.save(per_rank, tmp)
                    os.replace(tmp, os.path.join(partial, f"rank{ctx.rank}.pt"))
                else:  # one put of the whole object: it exists complete or not at all
                    buffer = io.BytesIO()
                    torch.save(per_rank, buffer)
                    ctx.fs.pipe_file(tmp, buffer.getvalue())
            except storage.SAVE_ERRORS as exc:
                error = exc
            ok = self._agree(error, step, partial, where=tmp)  # torch.save's errors do not name the file
        info = {"step": step, "world_size": ctx.world_size}
        if self.describe_run is not None:
            info["run"] = self.describe_run()
        if ok and ctx.settings.async_save and not blocking:
            future = dcp.async_save(dict(ctx.shared), **self._dcp_target(partial), process_group=ctx.writer_group)
            self._pending, self._pending_step = future, step
            if ctx.rank == 0:
                self.committed.clear()
                self._commit_error = None
                future.add_done_callback(lambda f: self._finish(f, partial, final, info))
        elif ok:
            try:
                # DCP raises on every rank when any rank's write failed; it returns on the
                # coordinator only after every rank's data is written (it gathers their
                # results before writing .metadata).
                dcp.save(dict(ctx.shared), **self._dcp_target(partial), process_group=ctx.group)
                if ctx.rank == 0:
                    self._commit(partial, final, info)
            except storage.SAVE_ERRORS as exc:
                error = exc
            ok = self._agree(error, step, partial)
            if ok:
                self._saved(step)
        ctx.last_save_time = time.monotonic()
        self.blocking_s.append(time.perf_counter() - started)
        return ok

    def save_final(self, step: int) -> bool:
        """See :meth:`slipstream.checkpoint.manager.CheckpointManager.save_final`."""
        ok = self.wait()
        if step > 0 and self.ctx.last_saved_step != step and self.ctx.directory is not None:
            ok = self.save(step, blocking=True)
        return ok

    def _write_dir(self, step: int) -> str:
        """Where the files of ``step`` are written: ``step_N.partial`` locally, ``step_N/`` in an object store."""
        return layout.step_dir(self.ctx.directory, step, partial=self.ctx.fs is None)

    def _dcp_target(self, path: str) -> dict:
        """DCP's destination: a local path as today; in an object store its fsspec writer
        (with ``storage_options``; ``checkpoint_id`` alone would drop them)."""
        if self.ctx.fs is None:
            return {"checkpoint_id": path}
        return {"storage_writer": remote.dcp_writer(path, self.ctx.storage_options)}

    def _finish(self, future: Future, partial: str, final: str, info: dict) -> None:
        # The writer thread, rank 0 only. A failure is kept for wait(), where all ranks agree on it.
        try:
            if future.exception() is None:
                self._commit(partial, final, info)
        except storage.SAVE_ERRORS as exc:
            self._commit_error = exc
        finally:
            self.committed.set()

    def _check_lease(self) -> None:
        """Every rank stops writing once rank 0's heartbeat found its lease taken over
        (another job writes here now): one small all-reduce per save."""
        lost = torch.tensor([int(self.lease is not None and self.lease.lost)], dtype=torch.int32)
        if self.ctx.many:
            dist.all_reduce(lost, op=dist.ReduceOp.MAX, group=self.ctx.group)
        if lost.item():
            raise lease.CheckpointDirInUse(
                f"checkpoint_dir {self.ctx.directory}: another job took over its writer lease (rank 0's log names it); "
                "this job writes no more checkpoints there"
            )

    def _commit(self, partial: str, final: str, info: dict) -> None:
        # Rank 0 reads every file back for its checksum (about 2 GB/s from the page cache:
        # +30% on a synchronous save of 269 MB here, docs/fault-tolerance.md), in the writer
        # thread when async. checkpoint_verify=size or off records sizes only, skipping that.
        ctx = self.ctx
        files = integrity.describe_files(partial, checksums=ctx.settings.verify == "full", fs=ctx.fs)
        if ctx.fs is None:
            layout.commit(partial, final, {**info, "files": files})
        else:
            # The marker is the commit: put it only once DCP's .metadata (written by the
            # coordinator after every rank's shards) and every rank's file are there.
            expected = [".metadata"] + ([f"rank{r}.pt" for r in range(ctx.world_size)] if ctx.per_rank else [])
            missing = [name for name in expected if name not in files]
            if missing:
                raise FileNotFoundError(f"{final}: {', '.join(missing)} not found after the write; not committed")
            layout.commit_marker(final, {**info, "files": files}, ctx.fs)
        layout.prune(ctx.directory, ctx.settings.keep_last, in_flight_step=None, fs=ctx.fs)
        # Not last_saved_step: this runs on rank 0 alone (in the writer thread when async);
        # last_saved_step is set on every rank once they agreed the save was written (_saved).
        if ctx.fs is None:  # free space is a local notion; an object store has none to check
            self._check_space(sum(entry["bytes"] for entry in files.values()))

    def _check_space(self, one_checkpoint: int) -> None:
        if not self._space_checked:  # once per run, after the first commit: its size is known now
            self._space_checked = True
            warning = storage.space_warning(self.ctx.directory, self.ctx.settings.keep_last, one_checkpoint)
            if warning:
                log.warning("%s", warning)

    def wait(self) -> bool:
        """See :meth:`slipstream.checkpoint.manager.CheckpointManager.wait`."""
        if self._pending is None:
            return True
        step, error = self._pending_step, None
        try:
            self._pending.result()
        except storage.SAVE_ERRORS as exc:
            error = exc
        if self.ctx.rank == 0:
            if not self.committed.wait(timeout=60):
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
        self.ctx.last_saved_step = step
        self.consecutive_failures = 0
        self.last_save_failed = False

    def _agree(self, error: BaseException | None, step: int, partial: str, where: str | None = None) -> bool:
        """All ranks learn whether any rank failed (one all-reduce); on failure, every
        rank also gets the first failing rank's description and follows the policy."""
        ctx = self.ctx
        flag = torch.tensor([int(error is not None)], dtype=torch.int32)
        many = ctx.many
        if many:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ctx.group)
        if not flag.item():
            return True
        description = None
        if error is not None:
            try:
                description = self._describe(error, where or partial)
            except Exception as exc:  # noqa: BLE001 - describing must not break the agreement (a hang)
                description = f"{type(error).__name__}: {error} writing {where or partial} ({exc} while describing it)"
        if many:
            gathered: list = [None] * ctx.world_size
            dist.all_gather_object(gathered, (ctx.rank, description), group=ctx.group)
            rank, description = next(item for item in gathered if item[1] is not None)
            if rank and not description.startswith("rank "):
                description = f"rank {rank}: {description}"
        self._save_failed(step, partial, description)  # type: ignore[arg-type]  (some rank failed: not None)
        return False

    def _describe(self, error: BaseException, partial: str) -> str:
        ctx = self.ctx
        latest = layout.find_latest(ctx.directory, ctx.fs)
        size = source = None
        if latest is not None:
            try:
                size, source = integrity.checkpoint_bytes(latest.info), f", from {os.path.basename(latest.path)}'s marker"
            except (OSError, ValueError):
                pass
        if size is None and ctx.world_size == 1:
            # One rank only: on a sharded layout state_dict() may be collective, and only
            # the failing rank describes the failure (a hang). Several ranks: "unknown".
            size = sum(storage.state_bytes(obj.state_dict()) for obj in ctx.shared.values())
            source = ", estimated from the state's tensors"
        return storage.describe_failure(error, partial, size, source or "")

    def _save_failed(self, step: int, partial: str, description: str) -> None:
        """The policy: warn loudly and keep training (the next interval retries), until
        ``max_failures`` saves in a row failed; then exit 1 (CheckpointSaveFailed)."""
        ctx, max_failures = self.ctx, self.ctx.settings.max_failures
        self.consecutive_failures += 1
        self.last_save_failed = True
        if ctx.rank == 0:  # every rank is past its writes: the agreement said so
            if ctx.fs is None:
                shutil.rmtree(partial, ignore_errors=True)
            else:
                try:
                    layout.discard_unmarked(partial, ctx.fs)
                except Exception as exc:  # noqa: BLE001 - debris: the next prune retries
                    log.warning("checkpoint_dir %s: %s not deleted (%s); the next prune retries", ctx.directory, partial, exc)
        latest = layout.find_latest(ctx.directory, ctx.fs)
        kept = f"{os.path.basename(latest.path)} is intact" if latest else "no earlier checkpoint exists"
        what = "emergency checkpoint (SIGTERM)" if ctx.preempt_requested else "checkpoint"
        message = f"{what} of step {step} not written: {description}; {kept}"
        if self.consecutive_failures >= max_failures:
            raise storage.CheckpointSaveFailed(
                f"{message}; giving up after {self.consecutive_failures} failed saves in a row "
                f"(checkpoint_max_failures={max_failures})"
            )
        if ctx.rank == 0:
            log.error(
                "%s; training continues and retries at the next save (failure %d of checkpoint_max_failures=%d)",
                message, self.consecutive_failures, max_failures,
            )
