"""Run one launch on an emulated cluster: build it, run an agent per node, delete it.

:class:`~slipstream.launch.emulate.EmulatedCluster` is the cluster (namespaces, shaped links,
the nodes' agents, a lost node's return); this module is the job around it, as
``slipstream run --emulate NxP`` and ``slipstream job run --emulate`` use it: the checks a real
launch makes, the run directory, the start line, the launcher's summary, and the cluster removed
on success, failure, Ctrl-C and SIGTERM alike.

Example::

    run_emulated(2, 1, "200mbit", LaunchOptions("train.py", ["--steps", "20"]))
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time

from ..errors import EXIT_INTERRUPTED, UsageError
from ..log import CONSOLE, set_level
from ..process import safe_signals
from . import emulate
from .api import LaunchOptions, with_run_dir
from .emulate import RDZV_PORT, EmulatedCluster, parse_link
from .summary import summary_lines

log = logging.getLogger("slipstream.launch.emulate")


class _Terminated(Exception):
    pass


def run_emulated(nodes: int, procs_per_node: int, link: str, base: LaunchOptions) -> int:
    """Run ``base`` on an emulated cluster of ``nodes`` x ``procs_per_node`` with ``link`` per node.

    Builds the namespaces and shaped links, runs one elastic agent per node,
    deletes everything afterwards (success, failure, Ctrl-C, SIGTERM) and
    returns the job's exit code: 0, 1 (training failed), 2 (a worker's usage or
    configuration error) or 130 (interrupted).
    Raises :class:`UsageError` without root/CAP_NET_ADMIN or on bad arguments.

    Example::

        run_emulated(2, 1, "200mbit", LaunchOptions("train.py", ["--steps", "20"]))
    """
    if nodes < 1 or procs_per_node < 1:
        raise UsageError(f"--emulate needs at least 1 node and 1 process per node, got {nodes}x{procs_per_node}")
    parse_link(link)
    # Same checks as a real launch (script exists, restarts >= 0, ...), for this shape.
    dataclasses.replace(
        base, nproc_per_node=procs_per_node, min_nodes=nodes, max_nodes=nodes, node_rank=0,
        rdzv_endpoint=f"127.0.0.1:{RDZV_PORT}",
    ).validate()
    why = emulate.missing_privileges()  # through the module: tests replace it there
    if why:
        raise UsageError(f"--emulate cannot build a cluster here: {why}")

    cluster = EmulatedCluster(nodes, link=link)
    # The run directory, chosen here (as the agents would: runs/<rendezvous id>) so that this
    # process can say where the run went once every node is done.
    rdzv_id = base.rdzv_id or f"emu-{cluster.run_id}"
    base = dataclasses.replace(base, worker_env=with_run_dir(
        dataclasses.replace(base, rdzv_id=rdzv_id, min_nodes=nodes, max_nodes=nodes)).worker_env)
    logger = logging.getLogger("slipstream")
    saved_level = logger.level
    if base.log_level is not None:
        set_level(base.log_level)
    try:
        started = time.monotonic()
        code = _run_on(cluster, base, procs_per_node)
        if base.summary:
            run_dir = base.worker_env.get("SLIPSTREAM_RUN_DIR") or os.environ.get("SLIPSTREAM_RUN_DIR")
            for line in summary_lines(run_dir, code, time.monotonic() - started):
                log.info(line, extra=CONSOLE)
        return code
    finally:
        logger.setLevel(saved_level)


def _run_on(cluster: EmulatedCluster, base: LaunchOptions, procs_per_node: int) -> int:
    """:func:`run_emulated` on ``cluster``: built, run, deleted (also on Ctrl-C and SIGTERM)."""
    nodes = cluster.nodes
    in_main = threading.current_thread() is threading.main_thread()
    # Raised outside stdlib code only: a SIGTERM inside Popen.poll must not blind the wait for the agents.
    previous = signal.signal(signal.SIGTERM, safe_signals.handler(_Terminated)) if in_main else None
    try:
        cluster.up()
        log.info(
            f"slipstream run: emulated cluster {nodes}x{procs_per_node}, link {cluster.link_spec.describe()}, "
            f"namespaces {cluster.node_list[0].netns}..{cluster.node_list[-1].netns}, "
            f"rendezvous {cluster.rdzv_endpoint}",
            extra=CONSOLE,
        )
        return cluster.run(base, procs_per_node)
    except (KeyboardInterrupt, _Terminated):
        log.info("slipstream run: interrupted; emulated cluster removed", extra=CONSOLE)
        return EXIT_INTERRUPTED
    finally:
        # A second Ctrl-C must not leave namespaces behind: hold it off while deleting.
        held = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
        try:
            cluster.down()
        finally:
            if in_main:
                signal.signal(signal.SIGINT, held if held is not None else signal.default_int_handler)
        if in_main:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
