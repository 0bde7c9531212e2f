"""Workers die with their launcher: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` plus a check that closes the race.

torch's elastic agent starts every worker in a session of its own
(``start_new_session=True``), so when the agent dies without cleaning up (SIGKILL,
the OOM killer, a crashed node agent) nothing reaches its workers: they keep
training, keep writing checkpoints, and a relaunch then runs beside them. The
launcher therefore puts its own pid in the workers' environment
(``SLIPSTREAM_AGENT_PID``) and the worker entry calls :func:`die_with_agent`
before it imports torch:

1. ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the worker when its
   parent goes.
2. ``os.getppid()`` is compared with the recorded pid. An agent that died
   between its fork and step 1 has already handed the worker to init (or a
   subreaper), and no death signal will ever come: the worker exits 1 at once
   with one line on stderr.

Why SIGKILL and not SIGTERM: a worker that gets SIGTERM runs the preemption
handler, which writes an emergency checkpoint. With the launcher gone that is a
second writer racing the relaunch for the same checkpoint directory, the very
thing this module exists to stop. The last complete checkpoint is the one to
resume from.

Why the death signal is enough, with no watcher thread: the kernel sends it
when the *thread* that forked the child exits, not the process. In torch 2.13
the workers are forked by ``SubprocessHandler._popen`` (``subprocess.Popen``),
called from ``SubprocessContext._start`` <- ``start_processes`` <-
``LocalElasticAgent._start_workers``, which ``agent.run()`` calls, restarts
included, on the thread that called ``elastic_launch`` (checked in
``torch/distributed/elastic/``: no thread or executor on that path). That thread
stays inside ``agent.run()`` until the workers have ended, and the agent stops
its workers on every way out of it, so the forking thread outlives its workers
unless the process dies, which is the case we want. A thread polling
``os.getppid()`` would add a thread to every worker and up to a poll interval of
delay for nothing.

What the check does not cover: when something stands between agent and worker
(a ``PYTHON_EXEC`` wrapper that does not ``exec``), ``getppid()`` is the
wrapper and the agent is still alive; the worker then carries on, armed against
the wrapper's death only. The variable stays in the environment: the
checkpoint lease (:mod:`slipstream.checkpoint.lease`) names the agent by it.
DataLoader worker processes watch their own parent (torch's ``ManagerWatchdog``
compares ``os.getppid()`` each time a fetch times out, every 5 s), so they end
within about 5 s of the worker. Without the variable (a worker started by plain
``torchrun`` or by hand) nothing is done; off Linux nothing is done either.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import MutableMapping

from ..resilience.pids import alive

ENV_AGENT_PID = "SLIPSTREAM_AGENT_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent thread dies; False off Linux or on failure."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc symbol table (static builds, unusual loaders)
        return False


def die_with_agent(environ: MutableMapping[str, str] | None = None) -> bool:
    """Arm the worker to die with the launcher named in ``SLIPSTREAM_AGENT_PID``; exit 1 if it is gone already.

    Returns True when the death signal is armed and the parent is the agent,
    False when there is nothing to do (no variable, not Linux, a wrapper in
    between). ``environ`` defaults to ``os.environ``.

    Example::

        die_with_agent()   # first thing in the worker entry, before torch's import
    """
    env = os.environ if environ is None else environ
    raw = env.get(ENV_AGENT_PID)
    if not raw or not sys.platform.startswith("linux"):
        return False
    try:
        agent = int(raw)
    except ValueError:
        return False
    armed = set_parent_death_signal(signal.SIGKILL)
    if os.getppid() == agent:  # read after arming: a parent that dies from here on kills us
        return armed
    if alive(agent):
        return False  # a wrapper process between the agent and us; see the module docstring
    sys.exit(f"slipstream worker: the launcher (pid {agent}) is gone; exiting")
