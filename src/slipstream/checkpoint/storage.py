"""Naming a failed checkpoint save in one line: what failed, where, the free space,
and how large one checkpoint is.

A full disk surfaces from torch.save as ``RuntimeError: [enforce fail at
inline_container.cc:672] . unexpected pos 704 vs 598`` (its zip writer saw a
short write) and from DCP as an OSError wrapped in a CheckpointException per
rank; neither says "disk full". :func:`describe_failure` finds the OSError
underneath, or recognises the short write, and adds what the user needs to
act: the free space on that file system and the size of a checkpoint.

Example::

    try:
        torch.save(state, path)
    except RuntimeError as exc:
        print(describe_failure(exc, path, one_checkpoint_bytes=3_400_000))
        # no space left on device writing ckpt/step_00000020.partial/rank0.pt (1.2 MB free ...
"""

from __future__ import annotations

import errno
import os
import shutil
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import EXIT_TRAINING_FAILED, SlipstreamError
from . import remote
from .layout import list_complete

SAVE_ERRORS = (Exception, CheckpointException)  # DCP's CheckpointException is a BaseException

_ERRNO_NAMES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded (no space left for this user)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
}


_NEARLY_FULL_BYTES = 1 << 20  # below this, a write error without an errno is taken for a full disk


class CheckpointSaveFailed(SlipstreamError):
    """Checkpoints failed ``checkpoint_max_failures`` times in a row (exit 1)."""

    exit_code = EXIT_TRAINING_FAILED


def root_cause(exc: BaseException) -> BaseException:
    """The first OSError inside ``exc`` (DCP's per-rank failures, causes, contexts), else ``exc``.

    Example::

        root_cause(checkpoint_exception)   # OSError(28, 'No space left on device')
    """
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        if isinstance(current, CheckpointException):
            todo.extend(failure[0] for failure in current.failures.values())
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return exc


def failing_rank(exc: BaseException) -> int | None:
    """The lowest rank DCP reports a failure for (its exception is raised on every rank), else None."""
    if isinstance(exc, CheckpointException) and exc.failures:
        return min(exc.failures)
    return None


def free_bytes(path: str) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing parent);
    None for an object store's URL (no such notion there)."""
    if remote.is_url(path):
        return None
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: an estimate of a checkpoint's size."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def human(n: int | None) -> str:
    """``3400000`` -> ``"3.2 MiB"``; None -> ``"unknown"``."""
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def describe_failure(exc: BaseException, path: str, one_checkpoint_bytes: int | None, size_source: str = "") -> str:
    """One line: what failed, the path, the free space there, and one checkpoint's size.

    Example::

        describe_failure(OSError(28, "No space left on device"), "ckpt/step_00000020.partial", 3_400_000)
        # 'no space left on device writing ckpt/step_00000020.partial (1.2 MiB free there; one checkpoint is 3.2 MiB)'
    """
    cause = root_cause(exc)
    free = free_bytes(path)
    where = getattr(cause, "filename", None) or path
    text = _first_line(cause)
    if isinstance(cause, OSError) and cause.errno in _ERRNO_NAMES:
        what = _ERRNO_NAMES[cause.errno]
    elif "No space left" in text:
        what = "no space left on device"
    elif free is not None and free < max(one_checkpoint_bytes or 0, _NEARLY_FULL_BYTES):
        # torch.save on a full disk raises without an errno: "unexpected pos 704 vs 598" (its zip
        # writer saw a short write) or "basic_ios::clear: iostream error" (both seen on a full tmpfs).
        what = f"no space left on device ({type(cause).__name__}: {text})"
    elif "unexpected pos" in text:
        what = f"a write was cut short ({text})"
    else:
        what = f"{type(cause).__name__}: {text}"
    size = f"one checkpoint is {human(one_checkpoint_bytes)}{size_source}"
    rank = failing_rank(exc)
    who = f"rank {rank}: " if rank else ""  # DCP raises a peer's failure here too: name the peer
    if remote.is_url(path):  # an object store: no free space to report
        return f"{who}{what} writing {where} ({size})"
    return f"{who}{what} writing {where} ({human(free)} free there; {size})"


def space_warning(directory: str, keep_last: int, one_checkpoint_bytes: int) -> str | None:
    """A warning when ``keep_last`` checkpoints (and the next one, written before the
    oldest is pruned) will not fit in the free space of ``directory``; else None.

    Example::

        space_warning("ckpt", 3, 500_000_000)   # "checkpoint_dir ckpt: one checkpoint is 476.8 MiB; ..."
    """
    kept = len(list_complete(directory))
    needed = (keep_last + 1 - kept) * one_checkpoint_bytes
    free = free_bytes(directory)
    if free is None or free >= needed:
        return None
    return (f"checkpoint_dir {directory}: one checkpoint is {human(one_checkpoint_bytes)}; keeping "
            f"checkpoint_keep_last={keep_last} needs {human(needed)} more ({kept} kept now, one more while the "
            f"next is written), {human(free)} free: saves will fail with no space left; free space, lower "
            "checkpoint_keep_last or point checkpoint_dir elsewhere")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
