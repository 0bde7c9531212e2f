"""Let torch's gloo worker threads finish before the interpreter tears down.

The failure this prevents (torch 2.13, gloo): a collective's work object keeps
the calling thread's thread-local state, which can hold Python objects. The
gloo worker thread that ran the collective ("pt_gloo_runloop") drops its
reference after the result is ready; when that is the last reference it takes
the GIL to free those Python objects. If the main thread has meanwhile reached
interpreter finalization, CPython ends the worker thread with a forced unwind
through a ``noexcept`` destructor and the process dies with SIGABRT
("terminate called without an active exception") after training succeeded.
Core dumps here show exactly that stack: ``~AsyncBarrierWork`` ->
``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` -> ``SafePyObject`` decref ->
``take_gil`` -> ``PyThread_exit_thread`` -> ``std::terminate``. Under load it
struck 7 of 180 plain ``torchrun`` runs of a 2-process DDP script here, and
CI runs; 0 of 140 under ``slipstream run`` with this module
(``benchmarks/exit_trials.py``).

The cure: before finalization, release the GIL until every gloo worker thread
is parked waiting for new work, which it only does after dropping its work.
No torch API reports that state, so it is read from ``/proc`` (Linux): a
parked thread sleeps in ``futex(FUTEX_WAIT_BITSET)`` with no timeout, the
condition-variable wait for work; a thread waiting for the GIL or inside a
collective waits with a timeout, and one freeing objects is running.
"""

from __future__ import annotations

import atexit
import os
import platform
import time

_WORKER_THREAD_NAME = "pt_gloo_runloop"
# futex syscall numbers; /proc/<tid>/syscall prints the number, then the arguments.
_FUTEX_SYSCALL = {"x86_64": 202, "aarch64": 98, "arm64": 98, "ppc64le": 221, "s390x": 238}
_FUTEX_WAIT_BITSET = 9
_FUTEX_CMD_MASK = 0x7F  # without FUTEX_PRIVATE_FLAG and FUTEX_CLOCK_REALTIME
_installed = False


def _gloo_worker_threads(task_dir: str) -> list[str]:
    names = []
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return names
    for tid in tids:
        try:
            with open(os.path.join(task_dir, tid, "comm")) as fh:
                if fh.read().strip() == _WORKER_THREAD_NAME:
                    names.append(os.path.join(task_dir, tid))
        except OSError:  # the thread ended meanwhile
            continue
    return names


def _parked(thread_dir: str, futex_nr: int) -> bool:
    """True when the thread sleeps in an untimed FUTEX_WAIT_BITSET (a condition-variable wait)."""
    try:
        with open(os.path.join(thread_dir, "syscall")) as fh:
            fields = fh.read().split()
    except OSError:
        return True  # the thread is gone: it holds nothing
    if len(fields) < 5 or fields[0] != str(futex_nr):
        return False
    op, timeout = int(fields[2], 16), int(fields[4], 16)
    return (op & _FUTEX_CMD_MASK) == _FUTEX_WAIT_BITSET and timeout == 0


def wait_for_gloo_workers(timeout_s: float = 2.0, task_dir: str = "/proc/self/task") -> bool:
    """Release the GIL until every gloo worker thread is parked; True when they are.

    Returns at once when the process has no gloo worker threads. Two readings
    in a row, a few milliseconds apart, must agree, so a thread caught between
    two states is not taken for parked. ``False`` after ``timeout_s`` (e.g. a
    collective stuck on a dead peer): the caller exits anyway. Where the
    thread states cannot be read (not Linux, unknown CPU), it sleeps 50 ms,
    which covers the window in practice.
    """
    futex_nr = _FUTEX_SYSCALL.get(platform.machine())
    if futex_nr is None or not os.path.isdir(task_dir):
        time.sleep(0.05)
        return True
    deadline = time.monotonic() + timeout_s
    calm = 0
    while True:
        threads = _gloo_worker_threads(task_dir)
        if not threads:
            return True
        calm = calm + 1 if all(_parked(t, futex_nr) for t in threads) else 0
        if calm >= 2:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)  # releases the GIL: a worker waiting for it gets it


def install() -> None:
    """Run :func:`wait_for_gloo_workers` at interpreter exit (idempotent).

    The handler runs after the script and the non-daemon threads finish and
    before finalization, where a worker thread can no longer take the GIL.
    """
    global _installed
    if not _installed:
        atexit.register(wait_for_gloo_workers)
        _installed = True
