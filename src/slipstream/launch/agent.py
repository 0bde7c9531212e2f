"""The elastic agent ``slipstream run`` starts: torch's ``LocalElasticAgent`` with two changes.

* **No restart on a usage error.** A worker exits 2 only for a usage or configuration error
  (a SlipstreamError such as ConfigError, the script's own argument parser, a script Python
  cannot open): deterministic, so every restart would fail the same way, each after a new
  rendezvous and start-up. When a failed attempt has a rank that exited 2, the agent is left
  no restart: it stops as when its budget is spent and ``launch`` reports the error, exit 2.
  "Any rank", not "every rank": a peer of the rank that left can fail with exit 1 (connection
  closed) before the agent looks; exit 2 is never the consequence of another rank's failure.

* **The rendezvous store outlives its clients.** The c10d rendezvous store lives in the agent
  of the node that hosts it (node rank 0). After a successful run torch's launcher has every
  agent close the rendezvous (``rdzv_handler.shutdown()``), a write to that store, and exit.
  The host's agent used to exit as soon as its own close was done, so another node's close
  (or its exit-barrier wait) could find the store gone: a ``TCPStore.cpp ... recvVector
  failed ... Did the remote server shutdown or crash?`` warning, "failed to shutdown the
  rendezvous ... RendezvousConnectionError" and a native stack trace after the run's last
  line, on a run that succeeded (2 of 4 emulated 2-node runs, issue #46). Now each other
  node, once closed, adds one to a counter in the store, its last word to it; the host waits
  (at most :data:`EXIT_WAIT_S`) until every other node has said it before it exits.

* **Its workers, written down for a node that comes back healing.** When the launcher that
  built an emulated cluster sets ``SLIPSTREAM_NODE_WORKERS_FILE``, each start of the workers
  writes there what :mod:`slipstream.launch.node_rejoin` needs to start them again as
  replacements after the whole node is lost: each worker's command line, environment and
  directory as the kernel holds them (``/proc/<pid>``: exactly what torch's agent gave it),
  and the rendezvous round's store (key prefix, nodes) for the exit barrier the
  lost agent can no longer join.

:func:`patched_agent` puts this agent in place of torch's for one ``elastic_launch``
(torch's ``launch_agent`` constructs ``LocalElasticAgent`` by name, and has no hook for
either). If a later torch renames these internals, runs go on as with torch's own agent.

Example::

    with patched_agent(is_store_host=True):
        elastic_launch(config, entrypoint)(*args)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Iterator

from ..errors import EXIT_USAGE

log = logging.getLogger(__name__)

EXIT_WAIT_S = 30.0
"""How long the store's host waits for the other nodes to close the rendezvous after a
successful run (torch's own close timeout is 30 s): they are alive, having passed the
exit barrier, so this bounds only a node lost in those last milliseconds."""
LEFT_KEY = "slipstream/agents_left"
"""The counter each node other than the host adds one to, after its close."""
_POLL_S = 0.02
RECORD_WAIT_S = 2.0
"""How long :func:`record_workers` waits for a worker's command line to be readable."""
ENV_WORKERS_FILE = "SLIPSTREAM_NODE_WORKERS_FILE"
"""Where each start of this node's workers is written down (set by the emulated cluster)."""


def record_workers(path: str, pids: dict[int, int], store: dict | None, proc_root: str = "/proc") -> None:
    """Write ``{"workers": [{local_rank, argv, env, cwd}], "store": store}`` to ``path`` (atomically).

    ``pids``: {local rank: pid} of the workers just started; each one's command line and
    environment are read from ``proc_root`` (``subprocess.Popen`` returns after the exec, so
    they are the worker's own). A worker already gone is left out: the file then does not
    describe the node, and no replacement is started from it.

    Example::

        record_workers("/tmp/n1.json", {0: 4242}, {"prefix": "torch.rendezvous.emu-ab12.0", "nodes": 2})
    """
    workers = []
    for local_rank, pid in sorted(pids.items()):
        # Popen forks with vfork: it returns once the child's exec let go of the parent's memory,
        # which is before the kernel lays out the new command line (read empty then, measured).
        deadline = time.monotonic() + RECORD_WAIT_S
        argv: list[str] = []
        try:
            while not argv and time.monotonic() < deadline:
                with open(f"{proc_root}/{pid}/cmdline", "rb") as fh:
                    argv = [a.decode() for a in fh.read().split(b"\0")[:-1]]
                if not argv:
                    time.sleep(_POLL_S)
            with open(f"{proc_root}/{pid}/environ", "rb") as fh:
                env = dict(e.decode(errors="surrogateescape").partition("=")[::2]
                           for e in fh.read().split(b"\0") if b"=" in e)
            cwd = os.readlink(f"{proc_root}/{pid}/cwd")
        except OSError:
            return
        if not argv or not env:
            return
        workers.append({"local_rank": local_rank, "argv": argv, "env": env, "cwd": cwd})
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"workers": workers, "store": store}, fh)
    os.replace(tmp, path)


def round_store(handler: object, nodes: int) -> dict | None:
    """The rendezvous round's store as :func:`record_workers` keeps it, or None when torch's
    handler does not say (a renamed internal: a node then comes back by a full restart)."""
    try:
        run_id = handler._settings.run_id  # type: ignore[attr-defined]
        round_ = handler._state_holder.state.round  # type: ignore[attr-defined]
    except AttributeError:
        return None
    return {"prefix": f"torch.rendezvous.{run_id}.{round_}", "nodes": int(nodes)}


def wait_for_clients(store: object, clients: int, timeout_s: float = EXIT_WAIT_S) -> bool:
    """On the store's host: wait until ``clients`` other nodes have added to :data:`LEFT_KEY`.

    True when they all did, False at the timeout (or when the store cannot be read: the host
    then exits as before). ``store``: a ``torch.distributed.Store`` (the rendezvous round's).

    Example::

        wait_for_clients(store, clients=1, timeout_s=5.0)   # True once the other node has left
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if int(store.add(LEFT_KEY, 0)) >= clients:  # type: ignore[attr-defined]
                return True
        except Exception as exc:  # noqa: BLE001 - the run is over: leave, whatever the store says
            log.debug(f"slipstream run: cannot read the rendezvous store at exit: {exc}")
            return False
        if time.monotonic() >= deadline:
            log.debug(f"slipstream run: {clients} node(s) did not confirm their exit in {timeout_s:g} s")
            return False
        time.sleep(_POLL_S)


def say_left(store: object) -> None:
    """On a node other than the store's host: the last word to the store (see the module docstring)."""
    try:
        store.add(LEFT_KEY, 1)  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - the host then waits out its timeout, nothing worse
        log.debug(f"slipstream run: could not tell the rendezvous store this node left: {exc}")


class _ClosingInOrder:
    """The rendezvous handler of a spec, whose ``shutdown()`` keeps the store's host last.
    Every other attribute is the handler's own."""

    def __init__(self, handler: object, agent: object, is_store_host: bool | None) -> None:
        self._handler = handler
        self._agent = agent
        self._is_store_host = is_store_host

    def __getattr__(self, name: str) -> object:
        return getattr(self._handler, name)

    def shutdown(self) -> bool:
        closed = self._handler.shutdown()  # type: ignore[attr-defined]
        agent = self._agent
        store = getattr(agent, "_store", None)  # the last round's rendezvous store (torch's agent keeps it)
        group = getattr(agent, "_worker_group", None)
        succeeded = group is not None and getattr(group.state, "name", "") == "SUCCEEDED"
        # Only after success: then every node passed the exit barrier and closes now. After a
        # failure some node may be gone, and the host must not wait for it.
        if store is None or not succeeded or self._is_store_host is None:
            return closed
        if self._is_store_host:
            wait_for_clients(store, max(0, int(group.group_world_size or 1) - 1))
        else:
            say_left(store)
        return closed


@contextlib.contextmanager
def patched_agent(is_store_host: bool | None) -> Iterator[None]:
    """Have torch's launcher build the agent this module describes, for one launch.

    ``is_store_host``: whether this node hosts the rendezvous store (node rank 0); None when
    unknown (several nodes without ``--node-rank``): the exit is then torch's own.
    """
    from torch.distributed.elastic.agent.server import api as agent_api
    from torch.distributed.launcher import api as launcher_api

    base = getattr(launcher_api, "LocalElasticAgent", None)
    if base is None or not hasattr(agent_api, "WorkerState"):
        yield
        return
    failed = agent_api.WorkerState.FAILED

    class SlipstreamAgent(base):  # type: ignore[misc, valid-type]
        def __init__(self, spec, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - torch's signature
            # launch_agent shuts the rendezvous down through this same spec object.
            spec.rdzv_handler = _ClosingInOrder(spec.rdzv_handler, self, is_store_host)
            super().__init__(spec, *args, **kwargs)

        def _start_workers(self, worker_group):  # noqa: ANN001, ANN202 - torch's signature
            pids = super()._start_workers(worker_group)
            path = os.environ.get(ENV_WORKERS_FILE)
            if path:
                handler = getattr(worker_group.spec.rdzv_handler, "_handler", worker_group.spec.rdzv_handler)
                record_workers(path, dict(pids), round_store(handler, worker_group.group_world_size))
            return pids

        def _monitor_workers(self, worker_group):  # noqa: ANN001, ANN202 - torch's signature
            result = super()._monitor_workers(worker_group)
            if result.state == failed and any(f.exitcode == EXIT_USAGE for f in result.failures.values()):
                self._remaining_restarts = 0
            return result

    launcher_api.LocalElasticAgent = SlipstreamAgent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = base
