"""The load path of a :class:`~slipstream.checkpoint.manager.CheckpointManager`.

:class:`Restorer` loads the newest state every rank holds: an in-memory snapshot
(:mod:`.snapshot_side`) when it is newer than the newest checkpoint on disk, else the newest
complete checkpoint that verifies (:mod:`.verify`), read as plain data only (:mod:`.safe_load`).
Every choice is rank 0's or agreed, so no rank is left alone in a collective load.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from . import layout, remote, safe_load, snapshots
from . import verify as integrity
from .context import ManagerContext
from .snapshot_side import SnapshotSide

log = logging.getLogger("slipstream.checkpoint")


class NoUsableCheckpoint(ConfigError):
    """The checkpoint directory held checkpoints, and none of them verifies (exit 2)."""


class Restorer:
    """Restores the registered objects, and remembers what from.

    ``device``: where per-rank tensors saved from a GPU are restored (None: this rank's device,
    :func:`slipstream.checkpoint.safe_load.default_device`). ``restored_from``: what
    :meth:`restore_latest` loaded (a checkpoint's directory, or a line naming a snapshot);
    ``restored_run``: rank 0's copy of the run description in the checkpoint loaded from disk.
    """

    def __init__(self, ctx: ManagerContext, memory: SnapshotSide, device: torch.device | None) -> None:
        self.ctx = ctx
        self.memory = memory
        # Where per-rank tensors saved from a GPU (error-feedback buffers) come back:
        # this rank's GPU, whichever index it had when saved. CPU tensors (RNG states)
        # stay on the CPU. None: this rank's device, looked up when a GPU tensor turns up.
        self.device = device
        self.restored_from: str | None = None
        self.restored_run: dict | None = None
        # For objects registered after the restore (register_restored()): where their state is.
        self._restored_path: str | None = None
        self._restored_unclaimed: dict[str, Any] = {}  # a snapshot's entries no object was registered for

    def restore_latest(self) -> int:
        """See :meth:`slipstream.checkpoint.manager.CheckpointManager.restore_latest`."""
        step = self._restore_latest()
        if self.memory.snapshots is not None:
            self.memory.snapshots.cadence.restart(step)
        return step

    def _restore_latest(self) -> int:
        ctx, snaps = self.ctx, self.memory.snapshots
        snapshot = snaps.agreed_newest(ctx.group) if snaps is not None else None
        if snapshot is not None:
            newest: list = [0 if ctx.directory is None else None]
            if ctx.rank == 0 and ctx.directory is not None:
                try:
                    latest = layout.find_latest(ctx.directory, ctx.fs)
                    newest[0] = latest.step if latest is not None else 0
                except Exception:  # noqa: BLE001 - a store that cannot be listed: the snapshot is the newest known
                    newest[0] = 0
            if ctx.many and ctx.directory is not None:
                dist.broadcast_object_list(newest, src=0, group=ctx.group)
            if snapshot >= newest[0] and self._restore_snapshot(snapshot):
                via = "".join(f"rank {r} from its peer copy on rank {h}; "
                              for r, h in sorted(snaps.from_peers.items()))  # type: ignore[union-attr]
                disk = ("no checkpoint_dir" if ctx.directory is None else
                        f"newest checkpoint in {ctx.directory}: {f'step {newest[0]}' if newest[0] else 'none'}")
                self.restored_from = f"an in-memory snapshot ({via}{disk})"
                ctx.last_save_time = time.monotonic()
                return snapshot
        if ctx.directory is None:  # no disk to fall back to
            return 0
        choice: list = [None]
        if ctx.rank == 0:
            try:
                choice[0] = integrity.choose_newest(ctx.directory, ctx.settings.verify, ctx.fs)
            except Exception as exc:  # noqa: BLE001 - told to every rank below, not raised here alone (a hang)
                choice[0] = f"checkpoint_dir {ctx.directory} cannot be searched for checkpoints: {exc}"
        if ctx.many:
            dist.broadcast_object_list(choice, src=0, group=ctx.group)
        if choice[0] is None:
            return 0
        if isinstance(choice[0], str):
            raise NoUsableCheckpoint(choice[0])
        path, step, saved_world = choice[0]
        # This rank's own file is read (and refused) before the collective load, and the
        # outcome agreed: a rank refusing alone would leave the others in DCP's load.
        per_rank, refusal = self._read_rank_file(path)
        safe_load.agree_refusal(refusal, ctx.group)
        # DCP copies every tensor into the registered one, on that tensor's device; its
        # non-tensor values (counters, scaler and scheduler state) and its metadata are
        # read as plain data, not as arbitrary pickles (refusals agreed there too).
        reader = remote.dcp_reader(path, ctx.storage_options) if ctx.fs is not None else None
        safe_load.dcp_load(dict(ctx.shared), path, process_group=ctx.group, storage_reader=reader, fs=ctx.fs)
        if per_rank is not None:
            for name, obj in ctx.per_rank.items():
                if name in per_rank:
                    obj.load_state_dict(per_rank[name])
        elif ctx.per_rank:
            log.warning(
                "checkpoint %s was written by %s rank(s); rank %d has no per-rank state there "
                "(RNG streams and gradient-sync buffers start fresh)", path, saved_world, ctx.rank
            )
        ctx.last_saved_step = step
        ctx.last_save_time = time.monotonic()
        self.restored_from = ctx.directory
        self._restored_path = path
        if ctx.rank == 0:
            try:
                self.restored_run = layout.CheckpointDir(path, step, ctx.fs).info.get("run")
            except (OSError, ValueError):  # verified a moment ago; a marker gone now only loses the comparison
                self.restored_run = None
        return step

    def _restore_snapshot(self, step: int) -> bool:
        """Load every rank's snapshot of ``step``, or none (False, every rank alike: then the
        disk checkpoint is loaded). Each rank reads its own first and the ranks agree before
        any registered object changes, so a rank that cannot read leaves no rank half-restored."""
        ctx, snaps = self.ctx, self.memory.snapshots
        tree, problem = None, ""
        try:
            tree = snaps.read(step, ctx.group)  # type: ignore[union-attr]  (peer copies: a collective)
        except Exception as exc:  # noqa: BLE001 - agreed below; the disk checkpoint is the fallback
            problem = f"rank {ctx.rank}: {type(exc).__name__}: {exc}"
        failed = torch.tensor([0.0 if tree is not None else 1.0])
        if ctx.many:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=ctx.group)
        if failed.item():
            if problem:
                log.warning("the in-memory snapshot of step %d cannot be read (%s): loading the newest "
                            "checkpoint on disk instead", step, problem)
            return False
        snaps.apply(tree, ctx.shared, ctx.per_rank)  # type: ignore[union-attr, arg-type]
        self._restored_unclaimed = {name: state for name, state in tree["shared"].items()  # type: ignore[index]
                                    if name not in ctx.shared}
        self._restored_path = None
        return True

    def load_late(self, name: str, obj: Any) -> bool:
        """Load shared ``obj``, registered after the restore, from what that restored, when it holds
        an entry ``name`` (True when it did). A collective when the restore was from disk."""
        ctx = self.ctx
        if name in self._restored_unclaimed:
            snapshots.MemorySnapshots.apply({"shared": {name: self._restored_unclaimed.pop(name)}, "per_rank": {}},
                                            {name: obj}, {})
            return True
        if self._restored_path is None:
            return False
        metadata = safe_load.check_dcp_metadata(self._restored_path, ctx.fs)
        held = any(key == name or key.startswith(name + ".") for key in metadata.state_dict_metadata)
        if held:
            reader = remote.dcp_reader(self._restored_path, ctx.storage_options) if ctx.fs is not None else None
            safe_load.dcp_load({name: obj}, self._restored_path, process_group=ctx.group, storage_reader=reader,
                               fs=ctx.fs)
        return held

    def _read_rank_file(self, path: str) -> tuple[dict | None, Exception | None]:
        """(this rank's per-rank state in checkpoint ``path`` or None when it has no file
        there, the error when the file cannot be used): never raises, so that every
        rank reaches the agreement (:func:`~.safe_load.agree_refusal`)."""
        ctx = self.ctx
        if not ctx.per_rank:
            return None, None
        rank_file = os.path.join(path, f"rank{ctx.rank}.pt")
        try:
            data = self._read_object(rank_file) if ctx.fs is not None else None
            if not (os.path.exists(rank_file) if ctx.fs is None else data is not None):
                return None, None
            return safe_load.load_rank_file(rank_file, self.device, data=data), None
        except safe_load.CheckpointRefused as exc:
            return None, exc
        except Exception as exc:  # noqa: BLE001 - an object store's read error: agreed, not raised alone (a hang)
            return None, OSError(f"checkpoint file {rank_file} cannot be read: {type(exc).__name__}: {exc}")

    def _read_object(self, url: str) -> bytes | None:
        try:
            return self.ctx.fs.cat_file(url)
        except FileNotFoundError:
            return None
