"""On-disk layout of a checkpoint directory, and which checkpoint counts.

    CKPT_DIR/
      step_00000120/            complete: it holds COMMITTED
        .metadata, __0_0.distcp ...   DCP files (model, optimizer, counters, scaler, scheduler, extra state)
        rank0.pt, rank1.pt ...        per-rank state: RNG streams, gradient-sync buffers
        COMMITTED                     JSON: step, world_size, time; written last
      step_00000150.partial/    being written, or left by a crash: never loaded

A checkpoint is written under ``.partial``, the marker is written once every
rank's files are down, and the directory is renamed (atomic on a POSIX file
system). A run killed at any moment leaves either the old checkpoint or the new
one, never half of one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass

MARKER = "COMMITTED"
_COMPLETE = re.compile(r"^step_(\d{8,})$")
_PARTIAL = re.compile(r"^step_(\d{8,})\.partial$")


@dataclass(frozen=True)
class CheckpointDir:
    path: str
    step: int

    @property
    def info(self) -> dict:
        with open(os.path.join(self.path, MARKER), encoding="utf-8") as f:
            return json.load(f)


def step_dir(root: str, step: int, partial: bool = False) -> str:
    return os.path.join(root, f"step_{step:08d}" + (".partial" if partial else ""))


def list_complete(root: str) -> list[CheckpointDir]:
    """Complete checkpoints under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _COMPLETE.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, MARKER)):
            found.append(CheckpointDir(path, int(match.group(1))))
    return sorted(found, key=lambda c: c.step)


def find_latest(root: str) -> CheckpointDir | None:
    """The newest complete checkpoint, or None.

    Example::

        latest = find_latest("ckpt")
        if latest: print(latest.step, latest.info["world_size"])
    """
    complete = list_complete(root)
    return complete[-1] if complete else None


def commit(partial_path: str, final_path: str, info: dict) -> None:
    """Write the marker (atomically) into ``partial_path``, then rename it to ``final_path``."""
    tmp = os.path.join(partial_path, MARKER + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({**info, "committed_unix_s": time.time()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(partial_path, MARKER))
    if os.path.exists(final_path):  # a re-save of the same step (e.g. after resume): replace it
        shutil.rmtree(final_path)
    os.replace(partial_path, final_path)
    _fsync_dir(os.path.dirname(final_path))


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def prune(root: str, keep_last: int, in_flight_step: int | None = None) -> list[str]:
    """Delete all but the ``keep_last`` newest complete checkpoints, and partial
    ones left by crashes (except the one being written). Returns what was removed."""
    removed = []
    complete = list_complete(root)
    for old in complete[: max(0, len(complete) - keep_last)]:
        shutil.rmtree(old.path, ignore_errors=True)
        removed.append(old.path)
    if os.path.isdir(root):
        for name in os.listdir(root):
            match = _PARTIAL.match(name)
            if match and int(match.group(1)) != in_flight_step:
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                removed.append(os.path.join(root, name))
    return removed
