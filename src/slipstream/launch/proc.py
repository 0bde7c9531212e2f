"""Process-tree helpers (Linux /proc).

The elastic agent starts each worker in a session of its own, so killing a
launcher's process group does not reach its workers; these walk the tree.
"""

from __future__ import annotations

import os
import signal


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
