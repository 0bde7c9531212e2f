"""Where in-memory snapshots live, and their deletion: torch-free, for the launcher.

The snapshots themselves are :mod:`slipstream.checkpoint.snapshots` (which imports torch and
DCP). The launcher deletes its workers' snapshots at exit and those of launchers that are gone
at start, and must not pay for importing the checkpoint package to do so (measured: 1.5 s
more per ``slipstream run`` on this machine, 4.6 s under load), so the directory layout's root
and the sweep live here, at the bottom of the layers with :mod:`slipstream.resilience.pids`.

Example::

    sweep(owner=os.getpid())   # in the launcher's finally: this launch's snapshots
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from . import pids

ENV_ROOT = "SLIPSTREAM_SNAPSHOT_DIR"
SUBDIR = "slipstream-snapshots"
ENV_REJOINS = "SLIPSTREAM_AGENT_REJOINS"
"""Set by the launcher for its workers: how many times its agent joined the job again after
losing the rendezvous store (the rendezvous host's node lost). The new agent counts its
restarts from 0, so without this its workers would take themselves for a new job's."""


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """How many times this launcher restarted its workers: 0 only for a new job's first attempt.

    Example::

        restart_count({"TORCHELASTIC_RESTART_COUNT": "0", "SLIPSTREAM_AGENT_REJOINS": "1"})   # 1
    """
    env = os.environ if environ is None else environ
    return int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) + int(env.get(ENV_REJOINS, "0") or 0)


ENV_OWNER = "SLIPSTREAM_SNAPSHOT_OWNER_PID"
"""Set by the supervisor of ``slipstream run --heal`` for its training process: the launcher's pid,
which is the snapshots' owner (the training process's parent is the supervisor there)."""


def owner_pid(environ: Mapping[str, str] | None = None) -> int:
    """The launcher whose snapshots this worker writes: its parent, or ``$SLIPSTREAM_SNAPSHOT_OWNER_PID``."""
    env = os.environ if environ is None else environ
    return int(env.get(ENV_OWNER) or os.getppid())


def root_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where snapshots live: ``$SLIPSTREAM_SNAPSHOT_DIR`` or ``/dev/shm``, plus ``slipstream-snapshots``."""
    env = os.environ if environ is None else environ
    return os.path.join(env.get(ENV_ROOT) or "/dev/shm", SUBDIR)


def sweep(environ: Mapping[str, str] | None = None, owner: int | None = None) -> list[str]:
    """Delete the snapshot directories of launcher ``owner`` (this one, at its exit) and of every
    launcher that no longer runs (killed before it could). Returns what was deleted.

    Example::

        sweep(owner=os.getpid())   # in the launcher's finally
    """
    removed = []
    root = root_dir(environ)
    for parent, dirs, files in os.walk(root, topdown=False):
        if "owner" in files:
            try:
                with open(os.path.join(parent, "owner")) as fh:
                    pid_text, _, start = fh.read().strip().partition(" ")
                pid = int(pid_text)
            except (OSError, ValueError):
                pid, start = 0, ""
            if pid == owner or not pids.alive(pid, start or None):
                shutil.rmtree(parent, ignore_errors=True)
                removed.append(parent)
        elif parent != root:
            try:
                os.rmdir(parent)  # a job's or launcher's directory, when left empty
            except OSError:
                pass
    return removed
