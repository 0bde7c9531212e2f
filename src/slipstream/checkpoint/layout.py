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

In an object store (``checkpoint_dir`` an fsspec URL, :mod:`.remote`) there is
no rename: the files go straight to ``step_N/`` and the marker, put last, is
the commit; a ``step_N/`` without it is debris, ignored and pruned. The
functions below take that store's filesystem as ``fs`` (None: a local directory).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from . import remote

MARKER = "COMMITTED"
_COMPLETE = re.compile(r"^step_(\d{8,})$")
_PARTIAL = re.compile(r"^step_(\d{8,})\.partial$")


@dataclass(frozen=True)
class CheckpointDir:
    path: str
    step: int
    fs: Any = field(default=None, compare=False, repr=False)  # the fsspec filesystem when ``path`` is a URL

    @property
    def info(self) -> dict:
        if self.fs is not None:
            return json.loads(self.fs.cat_file(remote.join(self.path, MARKER)))
        with open(os.path.join(self.path, MARKER), encoding="utf-8") as f:
            return json.load(f)


def step_dir(root: str, step: int, partial: bool = False) -> str:
    return os.path.join(root, f"step_{step:08d}" + (".partial" if partial else ""))


def list_complete(root: str, fs: Any = None) -> list[CheckpointDir]:
    """Complete checkpoints under ``root``, oldest first (``fs``: see the module's docstring;
    made from the environment when ``root`` is a URL and none is given)."""
    if fs is None and remote.is_url(root):
        fs = remote.filesystem(root)
    if fs is not None:
        return [CheckpointDir(remote.join(root, name), step, fs) for name, step in _remote_steps(root, fs)[0]]
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _COMPLETE.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, MARKER)):
            found.append(CheckpointDir(path, int(match.group(1))))
    return sorted(found, key=lambda c: c.step)


def _remote_steps(root: str, fs: Any) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(marked, unmarked) ``step_N`` prefixes under an object-store ``root``, oldest first, from one listing."""
    marked, seen = set(), set()
    for rel in remote.objects(fs, root):
        name, _, rest = rel.partition("/")
        match = _COMPLETE.match(name)
        if match and rest:
            seen.add((name, int(match.group(1))))
            if rest == MARKER:
                marked.add((name, int(match.group(1))))
    by_step = lambda item: item[1]  # noqa: E731
    return sorted(marked, key=by_step), sorted(seen - marked, key=by_step)


def find_latest(root: str, fs: Any = None) -> CheckpointDir | None:
    """The newest complete checkpoint, or None.

    Example::

        latest = find_latest("ckpt")
        if latest: print(latest.step, latest.info["world_size"])
    """
    complete = list_complete(root, fs)
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


def commit_marker(final_url: str, info: dict, fs: Any) -> None:
    """The commit in an object store: one put of the marker into ``final_url``, whose
    other objects are all written. A put is atomic: the marker is there whole or not at all."""
    data = json.dumps({**info, "committed_unix_s": time.time()}).encode()
    fs.pipe_file(remote.join(final_url, MARKER), data)
    fs.invalidate_cache()


def remove(path: str, fs: Any = None) -> None:
    """Delete a checkpoint (or debris), the marker first: one cut short halfway is
    never seen as complete, and is debris for the next prune."""
    if fs is None:
        shutil.rmtree(path, ignore_errors=True)
    else:
        remote.remove(fs, path, first=MARKER)


def discard_unmarked(path: str, fs: Any = None) -> None:
    """Delete a save that failed: a local ``.partial`` directory; in an object store the
    ``step_N/`` prefix, unless its marker is there (the commit happened: it is complete)."""
    if fs is None:
        shutil.rmtree(path, ignore_errors=True)
    else:
        fs.invalidate_cache()  # another rank wrote here: a cached listing would not show the marker
        if not fs.exists(remote.join(path, MARKER)):
            remote.remove(fs, path, first=MARKER)


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


def prune(root: str, keep_last: int, in_flight_step: int | None = None, fs: Any = None) -> list[str]:
    """Delete all but the ``keep_last`` newest complete checkpoints, and partial
    ones left by crashes (except the one being written). Returns what was removed.
    In an object store (``fs``) the partial ones are the unmarked ``step_N/`` prefixes."""
    if fs is not None:
        return _prune_remote(root, keep_last, in_flight_step, fs)
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


def _prune_remote(root: str, keep_last: int, in_flight_step: int | None, fs: Any) -> list[str]:
    complete, debris = _remote_steps(root, fs)
    doomed = [name for name, _ in complete[: max(0, len(complete) - keep_last)]]
    doomed += [name for name, step in debris if step != in_flight_step]
    for name in doomed:
        remove(remote.join(root, name), fs)
    return [remote.join(root, name) for name in doomed]
