"""Process helpers: the one way Slipstream stops processes it started, and tree walks (Linux /proc).

The elastic agent starts each worker in a session of its own, so killing a
launcher's process group does not reach its workers; these walk the tree.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    order, todo = [], [pid]
    while todo:
        current = todo.pop()
        order.append(current)
        todo.extend(children.get(current, []))
    return order


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid`` and all its descendants (gone ones are skipped)."""
    for victim in descendants(pid):
        try:
            os.kill(victim, sig)
        except ProcessLookupError:
            pass


def stop_processes(
    procs: list[subprocess.Popen],
    *,
    sig: int = signal.SIGTERM,
    grace_s: float = 10.0,
    process_group: bool = False,
) -> None:
    """Send ``sig`` to every live process, wait up to ``grace_s`` in all, then SIGKILL the rest.

    ``process_group=True`` signals each process's group (``os.killpg``): for
    children started with ``start_new_session=True`` that have children of their
    own (an elastic agent and its workers). Processes that are gone are skipped;
    every process has been reaped when this returns.

    Example::

        stop_processes([agent_a, agent_b], grace_s=10.0, process_group=True)
    """

    def send(p: subprocess.Popen, signum: int) -> None:
        if process_group:
            try:
                os.killpg(p.pid, signum)
                return
            except (ProcessLookupError, PermissionError):
                pass  # not a group leader, or the group is gone: the process itself
        if p.poll() is None:
            try:
                p.send_signal(signum)
            except ProcessLookupError:
                pass

    live = [p for p in procs if p.poll() is None]
    for p in live:
        send(p, sig)
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        if process_group:
            send(p, signal.SIGKILL)  # the group may outlive its leader
        elif p.poll() is None:
            send(p, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def set_policy(policy: int, pid: int | None = None) -> None:
    """Set the CPU scheduling policy of every thread of process ``pid`` (None: this one), those the
    imports started included (they inherited the policy of the thread that started them). Linux
    only: elsewhere nothing changes."""
    task = f"/proc/{pid or 'self'}/task"
    try:
        ids = [int(tid) for tid in os.listdir(task)]
    except OSError:
        ids = [pid or 0]
    for tid in ids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except (AttributeError, OSError):  # not Linux, or a thread that ended meanwhile
            pass
