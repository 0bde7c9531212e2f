"""Is a process alive? One answer for the launcher, the checkpoint lease and the data cache.

A zombie counts as gone (it has exited; only its exit status waits to be read),
a process we may not signal (EPERM: another user's) as alive, and with a start
time, a pid that now names another process (pids are reused) as gone.
Torch-free and at the bottom of the layers: the worker entry calls it before
torch is imported.

Example::

    alive(4121)                      # True while process 4121 runs
    alive(4121, start_time(4121))    # ... and is the same process as when the time was read
"""

from __future__ import annotations

import os


def start_time(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (Linux ``/proc``), or None: with
    the pid it names one process, so a reused pid is not taken for the old process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None  # field 22 of proc(5); fields[0] is field 3


def alive(pid: int, start: str | None = None) -> bool:
    """Whether process ``pid`` (started at ``start``, when given) runs on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            if f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X"):
                return False
    except (OSError, IndexError):
        pass  # no /proc: the kernel's answer stands
    if start is not None:
        now = start_time(pid)
        if now is not None and now != start:
            return False  # the pid was reused by another process
    return True
