"""A lost node comes back healing: its ranks start again as replacements, nobody else restarts.

When every process of an emulated node dies (:meth:`~.emulate.EmulatedCluster.lose_node`: its
elastic agent, supervisors, training processes and spares), the other nodes' training processes
see their next collective fail and go into the next heal generation (:mod:`slipstream.resilience.heal`),
waiting for ``world_size`` ranks. What must not happen is what a new agent would do: join the
rendezvous. torch's agent restarts its whole worker group when a node is waiting to join
(``LocalElasticAgent._invoke_run``: ``rdzv_handler.num_nodes_waiting() > 0`` while its workers
are healthy), so a restarted agent turns a heal into the full restart. A dead agent alone
changes nothing for the others: torch's agents only notice a lost peer agent at their next
rendezvous (its keep-alive expires), and there is none while their workers are healthy.

So the node is started again *without* an agent: this process stands in for it. It starts one
supervisor (:mod:`.supervisor`) per local rank with the very command line and environment the
lost agent gave its workers (written down at each start of the workers: :mod:`.agent`,
``record_workers``), plus ``SLIPSTREAM_HEAL_REPLACEMENT=1``: the same ranks, world size, launch
attempt (so the same heal keys) and heal store. Each training process then runs the script as a
replacement does after a single rank's death: a fake group up to ``accelerate()``, then the
survivors' generation, then the state every rank restores, its own from the snapshots' peer
copy on another node (its node's memory is gone; :mod:`slipstream.checkpoint.peer`).

The lost agent's part of the run's end is done here too: once its ranks succeeded it joins
the agents' exit barrier in the rendezvous round's store (torch's own ``store_util.barrier``,
same keys) and says it left (:func:`.agent.say_left`), so the other agents do not wait out
their timeouts for it. A rank that fails ends this process with exit 1 (the others are
stopped): the job's failure, as an agent's would be. This process dies with its supervisors'
parent death signal armed on it (``SLIPSTREAM_AGENT_PID``), and passes SIGTERM/SIGINT on.

Not covered (the cluster falls back to today's node restart, said in one line): the node
that hosts the rendezvous and the heal store (node 0: losing it loses both stores), a run
without healing, and a node whose workers' record is missing or incomplete.

Example (what :class:`~.emulate.EmulatedCluster` runs inside the lost node's namespace)::

    python -m slipstream.launch.node_rejoin /tmp/ss-ab12/n1.json 198.18.3.1:29400
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

from ..log import CONSOLE
from ..resilience import heal_env, snapshot_dirs
from .parent_death import ENV_AGENT_PID

log = logging.getLogger("slipstream.launch")

BARRIER_TIMEOUT_S = 300.0
"""The exit barrier's timeout, torch's agents' default (``exit_barrier_timeout``)."""
_DROPPED = ("TORCHELASTIC_ERROR_FILE",)  # the lost agent's temporary directory: nobody reads it now


def load(path: str) -> dict | None:
    """The workers' record at ``path`` (:func:`.agent.record_workers`), or None when there is
    none or it cannot stand in for the node (no worker, no round store)."""
    try:
        with open(path) as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not record.get("workers") or not record.get("store"):
        return None
    return record


def replacement_env(worker_env: dict[str, str], stand_in_pid: int) -> dict[str, str]:
    """A lost worker's environment for its replacement: the same rank and job, started as a replacement
    by ``stand_in_pid`` (which its supervisor dies with)."""
    env = {k: v for k, v in worker_env.items() if k not in _DROPPED}
    env[heal_env.REPLACEMENT] = "1"
    env[ENV_AGENT_PID] = str(stand_in_pid)
    return env


def _stop(procs: list[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass


def run(record: dict, endpoint: str) -> int:
    """Start the node's replacements, wait for them, then join the agents' exit barrier; the exit code."""
    procs = [subprocess.Popen(w["argv"], env=replacement_env(w["env"], os.getpid()), cwd=w["cwd"])
             for w in record["workers"]]
    forwarded = {"signal": None}

    def forward(signum: int, _frame: object) -> None:
        forwarded["signal"] = signum
        _stop(procs, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    failed: int | None = None
    try:
        while any(p.poll() is None for p in procs):
            if failed is None and any(p.returncode not in (None, 0) for p in procs):
                failed = next(p.returncode for p in procs if p.returncode not in (None, 0))
                _stop(procs, signal.SIGTERM)  # as an agent stops its workers when one fails
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [p.returncode for p in procs]
    if forwarded["signal"] is not None:
        return 128 + int(forwarded["signal"])
    if any(codes):
        failed = failed if failed is not None else next(c for c in codes if c)
        log.error(f"slipstream run: a replacement on this node failed (exit {failed})", extra=CONSOLE)
        return 2 if failed == 2 else 1
    _exit_barrier(record["store"], endpoint)
    return 0


def _exit_barrier(store_info: dict, endpoint: str) -> None:
    """Join the agents' exit barrier and say this node left, in the lost agent's place."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.utils import store as store_util

    from .agent import say_left

    try:
        from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID as key
    except ImportError:  # a renamed internal: the other agents wait out their own timeout, nothing worse
        return
    host, _, port = endpoint.rpartition(":")
    try:
        tcp = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=60))
        store = dist.PrefixStore(store_info["prefix"], tcp)
        store_util.barrier(store=store, world_size=int(store_info["nodes"]), key_prefix=key,
                           barrier_timeout=BARRIER_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the training succeeded; only the others' exit waits longer
        log.error(f"slipstream run: this node's exit barrier with the other nodes failed: {exc}", extra=CONSOLE)
        return
    say_left(store)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        log.error("usage: python -m slipstream.launch.node_rejoin WORKERS_JSON RDZV_HOST:PORT", extra=CONSOLE)
        return 2
    record = load(args[0])
    if record is None:
        log.error(f"slipstream run: {args[0]} does not describe this node's workers: it cannot come back healing",
                  extra=CONSOLE)
        return 1
    try:
        return run(record, args[1])
    finally:
        snapshot_dirs.sweep(owner=os.getpid())  # the replacements' snapshots (their supervisors' parent: this one)


if __name__ == "__main__":
    sys.exit(main())
