"""A warm spare of ``slipstream run --heal``: torch imported ahead, waiting to run a rank's script.

Started by the rank's supervisor (:mod:`slipstream.launch.supervisor`) with the rank's
environment. It arms itself to die with the supervisor, imports torch and the training
modules (the seconds a replacement would otherwise spend at the failure), then blocks
on stdin for one line of JSON: ``{"argv": [...], "replacement": bool}``. It then runs
the script as the worker entry does (:func:`slipstream.launch.worker.main`), as a
replacement when told so (:mod:`slipstream.resilience.heal`). An end of input without a line (the
supervisor stopping) ends it quietly. While it waits it also watches the heal store for an
eviction of its rank (:func:`slipstream.resilience.heal.watch_for_eviction`): the others found that rank's
training process hung, and the spare kills it, so the supervisor replaces it.

``--now`` (the rank's first training process, or a replacement made at the failure when no
spare was ready): the order is already on stdin, so there is nothing to be warm for; the spare
reads it at once and the script imports what it needs, no more (a script that builds no
DistributedDataParallel never pays torch._dynamo's seconds), and no eviction watcher starts
(it would be stopped before the script anyway).

``--idle`` (a spare made ahead, beside a training process): the imports run under
``SCHED_IDLE``, the lowest CPU priority, so they take only CPU the training leaves; once
activated, every thread goes back to ``SCHED_OTHER``. Not ``os.nice``: an unprivileged
process can raise its nice value but never lower it again, and the spare becomes the
training process. Linux only; elsewhere the spare imports at normal priority.

Example::

    echo '{"argv": ["train.py"], "replacement": false}' | python -m slipstream.launch.spare
"""

from __future__ import annotations

import json
import os
import sys
import threading

from slipstream.launch.proc import set_policy  # stdlib only: the spare starts in milliseconds

WATCH_JOIN_S = 5.0
"""The most the spare waits for its eviction watcher to end (one poll and one store call: milliseconds)."""


def main(argv: list[str] | None = None) -> None:
    from slipstream.launch.parent_death import die_with_agent

    die_with_agent()
    flags = sys.argv[1:] if argv is None else argv
    idle = "--idle" in flags
    if "--now" in flags:
        _run(sys.stdin.readline(), idle=False)
        return
    if idle and hasattr(os, "SCHED_IDLE"):
        set_policy(os.SCHED_IDLE)
    import torch  # noqa: F401 - the warm part: imported before the failure, not after
    import torch._dynamo  # noqa: F401 - DistributedDataParallel.__init__ imports it lazily: seconds (measured)
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import slipstream.data  # noqa: F401 - the loader and datasets
    import slipstream.train  # noqa: F401 - accelerate() and the checkpoint package
    from slipstream.resilience import heal

    # While it waits, the spare kills its rank's training process if that one hangs (the
    # others found it so: slipstream.resilience.heal's eviction); the supervisor then hands over to it.
    stop_watching = threading.Event()
    watcher = heal.watch_for_eviction(os.environ, stop_watching)
    line = sys.stdin.readline()
    stop_watching.set()
    if watcher is not None:
        # Ended before the script runs: a thread left in a store call when a short script ends
        # aborts the process in interpreter teardown (SIGABRT after a successful run).
        watcher.join(timeout=WATCH_JOIN_S)
    _run(line, idle)


def _run(line: str, idle: bool) -> None:
    """Run the script of the order ``line`` (none: the supervisor stopped first; end quietly)."""
    if not line.strip():
        return
    if idle and hasattr(os, "SCHED_OTHER"):
        set_policy(os.SCHED_OTHER)  # the training process now (the supervisor did so too, at once)
    order = json.loads(line)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the script gets no stdin, as under the agent
    os.close(devnull)
    from slipstream.launch import worker
    from slipstream.resilience import heal_env

    if order.get("replacement"):
        os.environ[heal_env.REPLACEMENT] = "1"
    worker.main(list(order["argv"]))


if __name__ == "__main__":
    main()
