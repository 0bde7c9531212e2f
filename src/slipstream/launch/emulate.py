"""An emulated multi-node cluster on one machine: network namespaces and shaped links.

``slipstream run --emulate 2x2 --link 1gbit train.py`` builds, for one run:

* one network namespace per node (``ss-<id>-n<i>``) and one for the switch
  (``ss-<id>-sw``), so nothing is added to the host's own network;
* in the switch namespace a bridge, and per node a veth pair whose node end
  (``ssn<i>``, address ``198.18.<k>.<i+1>/24``, from the benchmarking range of
  RFC 2544) sits in the node's namespace and whose other end (``ssp<i>``) is a
  port of the bridge;
* a ``tbf`` qdisc on both ends of every veth: on the node end it limits what
  the node sends, on the switch end what it receives. Shaping the egress of
  the bridge-side veth does the job of an ``ifb`` ingress device with one qdisc
  less, and ``netem`` does not exist in every kernel (it does not on our CI);
* with a round trip or a loss (``--link 100mbit,40ms,0.1%``: :mod:`.linkspec`),
  no veths: each node's interface ``ssn<i>`` is a TUN device held by a
  userspace forwarder in the switch namespace (:mod:`.forwarder`), which delays
  and drops packets between nodes and paces what each node receives; tbf on the
  TUN device shapes what it sends. A rate alone keeps the bridge above;
* one elastic agent per node, started with ``ip netns exec`` and
  ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set to the node's interface,
  joined by c10d rendezvous at node 0's address;
* per node, its own host memory for in-memory snapshots: ``SLIPSTREAM_SNAPSHOT_DIR``
  is a directory of that node alone (under the launcher's ``SLIPSTREAM_SNAPSHOT_DIR``
  or ``/dev/shm``), so a node that is lost loses its snapshots, as a real one does.

A node dies when its agent is killed by a signal (:meth:`EmulatedCluster.lose_node`
kills every process in its namespace with SIGKILL, as a machine that loses power).
The cluster then does what a real one's scheduler does for a failed pod: the node's
memory (its snapshot directory) is deleted and the node started again. Under ``--heal``
a node other than node 0 comes back *healing*, with no agent (:mod:`.node_rejoin`: a new
agent would rejoin the rendezvous, and torch's agents restart their workers for a node
waiting to join): its ranks start as replacements that join the survivors' next heal
generation, their state from the snapshots' peer copy; every other node keeps its
processes. Otherwise (no healing; node 0, which hosts the rendezvous and heal stores; no
record of the node's workers) its agent is started again, with the same node rank and
rendezvous, up to ``--max-restarts`` node restarts per run, and the other nodes' agents
restart their workers. An agent that exits with a code (its restarts spent, a usage
error) is not restarted: that is the job's failure.

Ranks of one node share its namespace. Gloo binds every rank to the address of
``GLOO_SOCKET_IFNAME``; a connection between two ranks of the same node goes to
an address that is local to the namespace, so the kernel routes it over the
namespace's loopback and it never touches the shaped link (measured: the node
interface's ``tx_bytes`` stays flat for intra-node traffic, see docs/cluster.md).

Everything is deleted when the run ends: on success, on failure, on Ctrl-C and
on SIGTERM. Names carry a random id, so two runs can coexist. Without root (or
CAP_NET_ADMIN + CAP_SYS_ADMIN) and the ``ip``/``tc`` tools, it refuses with a
:class:`~slipstream.errors.UsageError`.

Example::

    from slipstream.launch import LaunchOptions
    from slipstream.launch.emulate import EmulatedCluster, run_emulated

    code = run_emulated(2, 2, "1gbit", LaunchOptions("train.py", ["--steps", "50"]))

    with EmulatedCluster(2, link="100mbit,40ms,0.1%") as cluster:   # for tests and benchmarks
        cluster.run(LaunchOptions("train.py"), procs_per_node=1)
        cluster.cut_link(1)        # node 1 is partitioned away (its packets vanish)
        cluster.restore_link(1)
        cluster.tx_bytes(0)        # bytes node 0 has sent on its shaped link
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import EXIT_OK, EXIT_TRAINING_FAILED, EXIT_USAGE, UsageError
from ..log import CONSOLE
from ..resilience.snapshot_dirs import ENV_ROOT as SNAPSHOT_ENV_ROOT
from . import node_rejoin
from .agent import ENV_WORKERS_FILE
from .api import LaunchOptions
from .emulate_net import (  # noqa: F401  (re-exported: emulate.Node, emulate.NETNS_ETC, ... are its public names too)
    FORWARDER_MTU,
    NETNS_ETC,
    ClusterNetwork,
    Node,
)
from .linkspec import (  # noqa: F401  (re-exported: emulate.parse_rate, ... are its public names too)
    LINK_SYNTAX,
    MAX_RTT_S,
    LinkSpec,
    format_link,
    format_rate,
    parse_link,
    parse_rate,
    split_link_list,
    tbf_args,
)
from .proc import stop_processes
from .supervisor import DEFAULT_HEAL_LIMIT

log = logging.getLogger(__name__)

NS_PREFIX = os.environ.get("SLIPSTREAM_EMULATE_NS_PREFIX", "ss-")
"""Every namespace this module creates starts with this (tests set their own, to tell their
namespaces from those of runs going on beside them)."""
RDZV_PORT = 29400
"""Rendezvous port on node 0; free by construction, the namespace is new."""
ADDR_PREFIX = "198.18"
"""RFC 2544 benchmarking range; each cluster uses one /24 inside its own namespaces."""

_CAP_NET_ADMIN = 12
_CAP_SYS_ADMIN = 21

# ---------------------------------------------------------------------------
# Pure helpers (no side effects; unit-tested without root)
# ---------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, int]:
    """``"2x2"`` -> ``(2, 2)``: NODES x PROCS_PER_NODE.

    Example::

        parse_shape("4x1")   # (4, 1)
    """
    match = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", text or "")
    if not match:
        raise UsageError(f"--emulate must be NODESxPROCS, e.g. 2x2, got {text!r}")
    nodes, procs = int(match.group(1)), int(match.group(2))
    if nodes < 1 or procs < 1:
        raise UsageError(f"--emulate needs at least 1 node and 1 process per node, got {text!r}")
    if nodes > 64:
        raise UsageError(f"--emulate supports at most 64 nodes on one machine, got {nodes}")
    return nodes, procs


def missing_privileges() -> str | None:
    """Why this process cannot build namespaces, or None when it can (as far as we can tell)."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, this is {sys.platform}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is not installed"
    # Capabilities, not the user id, decide: root in a container may lack them.
    try:
        with open("/proc/self/status") as fh:
            caps = next((int(line.split()[1], 16) for line in fh if line.startswith("CapEff:")), None)
    except OSError:
        caps = None
    if caps is None:
        caps = ~0 if os.geteuid() == 0 else 0
    needed = (1 << _CAP_NET_ADMIN) | (1 << _CAP_SYS_ADMIN)
    if caps & needed != needed:
        who = "root without those capabilities" if os.geteuid() == 0 else f"user id {os.geteuid()}"
        return (f"it needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN (ip netns add mounts a namespace), "
                f"and this process is {who}")
    return None


def list_namespaces(prefix: str | None = None) -> list[str]:
    """Names of network namespaces starting with ``prefix`` (default :data:`NS_PREFIX`)."""
    prefix = NS_PREFIX if prefix is None else prefix
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip() and line.split()[0].startswith(prefix)]


# ---------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------


@dataclass
class EmulatedCluster:
    """Namespaces, bridge and shaped links for ``nodes`` nodes; a context manager.

    ``up()`` builds it, ``down()`` deletes it (idempotent; also called by
    ``__exit__``). ``run()`` starts one elastic agent per node and waits. The
    network is its :class:`~.emulate_net.ClusterNetwork` (``cluster.network``);
    the cluster keeps the nodes' processes: their environment, start, loss
    (:meth:`lose_node`) and restart.
    """

    nodes: int
    link: str | None = "unshaped"
    run_id: str = field(default_factory=lambda: secrets.token_hex(3))
    verbose: bool = False
    loss_seed: int | None = None
    """Seed of the forwarder's loss draws (tests: the same packets are lost on every run); None: random."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise UsageError(f"an emulated cluster needs at least 1 node, got {self.nodes}")
        if not re.fullmatch(r"[0-9a-z]{1,8}", self.run_id):
            raise UsageError(f"run id must be 1-8 lower-case letters or digits, got {self.run_id!r}")
        link_spec = parse_link(self.link)
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", NS_PREFIX):
            raise UsageError(f"namespace prefix must be 1-40 letters, digits, '_', '.' or '-', got {NS_PREFIX!r}")
        subnet = int(self.run_id, 36) % 250 + 1
        self.switch_ns = f"{NS_PREFIX}{self.run_id}-sw"
        self.node_list = [
            Node(
                rank=i,
                netns=f"{NS_PREFIX}{self.run_id}-n{i}",
                ifname=f"ssn{i}",
                addr=f"{ADDR_PREFIX}.{subnet}.{i + 1}",
                port=f"ssp{i}",
            )
            for i in range(self.nodes)
        ]
        self.network = ClusterNetwork(self.switch_ns, self.node_list, link_spec, self.verbose, self.loss_seed)
        self.bridge = self.network.bridge
        self._jobs = 0
        self._node_heals = 0  # nodes that came back healing in this run (node_rejoin)

    # -- building and deleting ---------------------------------------------------

    def up(self) -> "EmulatedCluster":
        """Create namespaces, bridge, veths, addresses and qdiscs. Cleans up if any step fails."""
        why = missing_privileges()
        if why:
            raise UsageError(f"--emulate cannot build a cluster here: {why}")
        try:
            self.network.build()
            self.set_link(self.link)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop every process left in the namespaces and delete them; safe to call twice."""
        self.network.down()
        for node in range(self.nodes):
            self.forget_memory(node)
        shutil.rmtree(os.path.dirname(self.workers_file(0)), ignore_errors=True)

    def __enter__(self) -> "EmulatedCluster":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    @property
    def namespaces(self) -> list[str]:
        """Names of this cluster's namespaces (switch first)."""
        return self.network.namespaces

    # -- links (the network's; see emulate_net.py) ---------------------------------

    @property
    def link_spec(self) -> LinkSpec:
        """The nodes' link in force (rate, round trip, loss)."""
        return self.network.link_spec

    @property
    def link_bits_per_s(self) -> int | None:
        """The nodes' link rate in bits per second; None when unshaped."""
        return self.network.link_spec.bits_per_s

    def set_link(self, link: str | None) -> None:
        """Set every node's link to ``link`` (``RATE[,RTT][,LOSS]``; ``unshaped`` removes shaping).

        A rate alone is shaped by tbf on both ends of each node's veth (the
        bridge). With a round trip or a loss, the forwarder carries the packets
        instead and tbf shapes each node's egress on its TUN device. Going from
        one kind to the other rebuilds the nodes' links (a cut link is restored).
        """
        spec = parse_link(link)
        self.network.set_link(spec)
        self.link = format_link(spec)

    def cut_link(self, node: int) -> None:
        """Partition node ``node`` away: its packets vanish (:meth:`.ClusterNetwork.cut_link`)."""
        self.network.cut_link(node)

    def restore_link(self, node: int) -> None:
        """Undo :meth:`cut_link`: node ``node``'s packets flow again at once."""
        self.network.restore_link(node)

    def tx_bytes(self, node: int, ifname: str | None = None) -> int:
        """Bytes sent so far by ``node`` on its shaped interface (or ``ifname``, e.g. ``lo``)."""
        return self.network.tx_bytes(node, ifname)

    @property
    def forwarder_pid(self) -> int | None:
        """Process id of the link forwarder (None when the bridge carries the links)."""
        return self.network.forwarder_pid

    def forwarder_cpu_s(self) -> float:
        """CPU seconds (user + system) the link forwarder has used so far; 0.0 without one."""
        return self.network.forwarder_cpu_s()

    def forwarder_counts(self) -> dict[str, int]:
        """Packets the link forwarder has handled so far, by fate (``forwarded``, ``lost``, ...); {} without one."""
        return self.network.forwarder_counts()

    # -- the nodes' processes ------------------------------------------------------

    def exec_argv(self, node: int, argv: list[str]) -> list[str]:
        """``argv`` wrapped to run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.node_list[node].netns, *argv]

    def node_env(self, node: int, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for a process of node ``node``: socket interface for gloo/NCCL, the node's
        own snapshot memory (:meth:`memory_dir`)."""
        env = dict(os.environ if base is None else base)
        ifname = self.node_list[node].ifname
        env["GLOO_SOCKET_IFNAME"] = ifname
        env["NCCL_SOCKET_IFNAME"] = ifname
        env["SLIPSTREAM_EMULATED_NODE"] = str(node)
        env["SLIPSTREAM_EMULATED_IFNAME"] = ifname
        env[SNAPSHOT_ENV_ROOT] = self.memory_dir(node)
        env[ENV_WORKERS_FILE] = self.workers_file(node)
        return env

    def workers_file(self, node: int) -> str:
        """Where node ``node``'s agent writes down its workers at each start (:mod:`.node_rejoin`
        starts them again from it); outside the node's memory, which a lost node loses."""
        return os.path.join(tempfile.gettempdir(), f"slipstream-emulated-{NS_PREFIX}{self.run_id}", f"n{node}.json")

    def memory_dir(self, node: int) -> str:
        """Node ``node``'s own host memory for in-memory snapshots (its ``SLIPSTREAM_SNAPSHOT_DIR``).

        The nodes share this machine's ``/dev/shm``; without a directory each, a node that is
        lost would keep its snapshots for its restarted workers, which no real node does.
        Under the launcher's own ``SLIPSTREAM_SNAPSHOT_DIR`` (default ``/dev/shm``); deleted
        when the node is lost and by :meth:`down`."""
        base = os.environ.get(SNAPSHOT_ENV_ROOT) or "/dev/shm"
        return os.path.join(base, "slipstream-emulated", f"{NS_PREFIX}{self.run_id}-n{node}")

    def forget_memory(self, node: int) -> None:
        """Delete node ``node``'s snapshot memory: what a lost machine's RAM holds is gone."""
        shutil.rmtree(self.memory_dir(node), ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(self.memory_dir(node)))  # the cluster's directory, once empty
        except OSError:
            pass

    def lose_node(self, node: int) -> list[int]:
        """Node ``node`` dies: every process in its namespace (its agent and workers) gets SIGKILL
        at once, as when a machine loses power. Returns the pids killed. During :meth:`run`, the
        node is then restarted as a lost node (see the module docstring)."""
        pids = [int(p) for p in self.network.netns_pids(self.node_list[node].netns)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    # -- running -----------------------------------------------------------------

    @property
    def rdzv_endpoint(self) -> str:
        # A new port for every job on this cluster: the previous job's store socket may
        # linger in TIME_WAIT, and the launcher's free-port check would refuse the old one.
        return f"{self.node_list[0].addr}:{RDZV_PORT + self._jobs % 1000}"

    def agent_argv(self, node: int, base: LaunchOptions, procs_per_node: int) -> list[str]:
        """The ``slipstream run`` command line of node ``node``'s elastic agent."""
        n = self.node_list[node]
        argv = [
            sys.executable, "-m", "slipstream", "run",
            "--nnodes", str(self.nodes),
            "--node-rank", str(node),
            "--rdzv-endpoint", self.rdzv_endpoint,
            "--rdzv-id", base.rdzv_id or f"emu-{self.run_id}",
            "--local-addr", n.addr,
            "-n", str(procs_per_node),
            "--max-restarts", str(base.max_restarts),
            "--no-summary",  # the launcher that built the cluster says it once, after every node is done
        ]
        if base.log_level is not None:
            argv += ["--log-level", base.log_level]
        # Said to every agent, so each agent and this process decide alike (node_rejoin needs to know).
        argv.append("--heal" if _heals(base, self.nodes, procs_per_node) else "--no-heal")
        if base.spares is not None:
            argv += ["--spares", str(base.spares)]
        rdzv_conf = getattr(base, "rdzv_conf", None) or {}
        if rdzv_conf:
            argv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in rdzv_conf.items())]
        if base.module:
            argv.append("-m")
        argv.append(base.entrypoint)
        if base.args and base.args[0].startswith("-"):
            argv.append("--")
        argv.extend(base.args)
        return argv

    def run(self, base: LaunchOptions, procs_per_node: int, timeout_s: float | None = None,
            failure_grace_s: float = 30.0, log_path: str | None = None, cwd: str | None = None) -> int:
        """Start one agent per node, wait for all; the job's exit code.

        0 when every node succeeded; otherwise 2 if a node exited 2 (a worker's
        usage or configuration error), else the first non-zero code (1 for a
        training failure). When one node fails, the others get
        ``failure_grace_s`` to notice and exit before they are stopped. A node
        whose agent is killed by a signal is lost and started again, up to
        ``base.max_restarts`` node restarts in all (see the module docstring).
        ``timeout_s``: stop everything after this long and return 1.
        ``log_path``: send the agents' stdout and stderr there (default: inherit).
        """
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        procs: list[subprocess.Popen] = []
        log_file = open(log_path, "ab") if log_path else None

        def start(i: int, argv: list[str] | None = None) -> subprocess.Popen:
            env = self.node_env(i)
            env.update(base.worker_env)
            # All nodes share this machine's cores: split them over every worker.
            env.setdefault("OMP_NUM_THREADS", str(max(1, cores // (self.nodes * procs_per_node))))
            os.makedirs(self.memory_dir(i), mode=0o700, exist_ok=True)
            os.makedirs(os.path.dirname(self.workers_file(i)), mode=0o700, exist_ok=True)
            return subprocess.Popen(self.exec_argv(i, argv or self.agent_argv(i, base, procs_per_node)),
                                    env=env, start_new_session=True, stdout=log_file, stderr=log_file, cwd=cwd)

        heals = _heals(base, self.nodes, procs_per_node)

        def rejoin(i: int) -> subprocess.Popen | None:  # node i back healing; None: it cannot (module docstring)
            if not heals or i == 0 or node_rejoin.load(self.workers_file(i)) is None:
                return None
            return start(i, [sys.executable, "-m", "slipstream.launch.node_rejoin", self.workers_file(i),
                             self.rdzv_endpoint])

        try:
            procs.extend(start(i) for i in range(self.nodes))
            return self._wait(procs, timeout_s, failure_grace_s, restart=start, node_restarts=base.max_restarts,
                              rejoin=rejoin if heals else None)
        finally:
            # Each agent leads a session of its own (start_new_session): stopping its
            # group reaches its workers too.
            stop_processes(procs, grace_s=10.0, process_group=True)
            self._jobs += 1
            if log_file is not None:
                log_file.close()

    def _restart_lost(self, procs: list[subprocess.Popen], codes: list[int | None],
                      restart: Callable[[int], subprocess.Popen], left: int,
                      rejoin: Callable[[int], subprocess.Popen | None] | None = None) -> tuple[int, bool]:
        """Start again each node whose agent (or stand-in) a signal killed (``codes``: the last poll):
        healing when ``rejoin`` can (:mod:`.node_rejoin`), else by a new agent while ``left`` node
        restarts remain. Returns (restarts left, whether a node was started). The node's other
        processes are killed first (a lost machine keeps none) and its snapshot memory deleted."""
        started = False
        for i, code in enumerate(codes):
            healing = rejoin is not None and self._node_heals < DEFAULT_HEAL_LIMIT
            if code is None or code >= 0 or (not healing and left <= 0):
                continue
            self.lose_node(i)
            self._wait_netns_empty(i)
            self.forget_memory(i)
            how = signal.Signals(-code).name
            back = rejoin(i) if healing and rejoin is not None else None
            if back is not None:
                self._node_heals += 1
                log.info(f"slipstream run: node {i} lost (killed by {how}); its memory is gone; its ranks come back "
                         "in place as replacements, healing: the other nodes keep their processes", extra=CONSOLE)
                procs[i], started = back, True
                continue
            if left <= 0:
                continue
            left -= 1
            why = " (node 0 hosts the rendezvous and heal stores: it cannot come back healing)" if healing and not i else ""
            log.info(f"slipstream run: node {i} lost (its agent was killed by {how}); its memory is gone; starting "
                     f"it again{why} ({left} node restart(s) of --max-restarts left)", extra=CONSOLE)
            procs[i], started = restart(i), True
        return left, started

    def _wait_netns_empty(self, node: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.network.netns_pids(self.node_list[node].netns):
            time.sleep(0.05)

    def _wait(self, procs: list[subprocess.Popen], timeout_s: float | None, grace_s: float,
              restart: Callable[[int], subprocess.Popen] | None = None, node_restarts: int = 0,
              rejoin: Callable[[int], subprocess.Popen | None] | None = None) -> int:
        started = time.monotonic()
        first_failure: int | None = None
        failed_at: float | None = None
        self._node_heals = 0
        while True:
            codes = [p.poll() for p in procs]
            # A node killed by a signal is lost: started again (healing, or while restarts remain), unless
            # some node has exited (the job is ending or failed: a new node would wait for gone peers).
            if (restart is not None and failed_at is None and (node_restarts > 0 or rejoin is not None)
                    and any(c is not None and c < 0 for c in codes) and not any(c is not None and c >= 0 for c in codes)):
                node_restarts, again = self._restart_lost(procs, codes, restart, node_restarts, rejoin)
                if again:
                    continue
            # Record failures before the all-done check: every agent may have
            # exited (some failing) between two polls.
            for c in codes:
                if c not in (None, 0) and first_failure is None:
                    first_failure, failed_at = (c if c > 0 else EXIT_TRAINING_FAILED), time.monotonic()
                # A node's usage error (exit 2: a worker's ConfigError, not restarted) is the
                # cause to report, even when a peer node noticed its departure first (exit 1).
                if c == EXIT_USAGE:
                    first_failure = EXIT_USAGE
            if all(c is not None for c in codes):
                return first_failure if first_failure is not None else EXIT_OK
            forwarder_code = self.network.forwarder_exit_code()
            if forwarder_code is not None:
                log.info(f"slipstream run: the emulated links' forwarder exited (code {forwarder_code}); "
                         "stopping the nodes", extra=CONSOLE)
                return EXIT_TRAINING_FAILED
            now = time.monotonic()
            if failed_at is not None and now - failed_at > grace_s:
                log.info(f"slipstream run: a node failed (exit {first_failure}); stopping the others", extra=CONSOLE)
                return first_failure
            if timeout_s is not None and now - started > timeout_s:
                log.info(f"slipstream run: emulated job ran past {timeout_s:.0f} s; stopping it", extra=CONSOLE)
                return EXIT_TRAINING_FAILED
            time.sleep(0.1)


def _heals(base: LaunchOptions, nodes: int, procs_per_node: int) -> bool:
    """Whether the nodes' agents heal in place: the launch's setting resolved for this shape as on real
    nodes (off across nodes unless ``--heal``: an emulated cluster behaves as the cluster it stands
    for, and healing's peer copy would add its snapshots to every link's bytes). With ``--heal`` a lost
    node other than node 0 comes back healing (:mod:`.node_rejoin`)."""
    return dataclasses.replace(base, nproc_per_node=procs_per_node, min_nodes=nodes, max_nodes=nodes).heals
