"""The emulated cluster's network: namespaces, the switch, each node's link and its shaping.

:class:`ClusterNetwork` builds, for one :class:`~.emulate.EmulatedCluster`, a network namespace
per node and one for the switch; in the switch namespace a bridge, and per node a veth pair to
it (a rate alone) or a TUN device held by the userspace forwarder (a round trip or a loss:
:mod:`.forwarder`); tbf shaping on each link; partitions (:meth:`ClusterNetwork.cut_link`) and
byte counters. It knows nothing of the processes that run on the nodes: the cluster starts,
loses and restarts those (its module docstring says how the whole works). Names and addresses
are the cluster's, given to the constructor.

Example::

    net = ClusterNetwork("ss-ab12-sw", nodes, parse_link("1gbit"), verbose=False, loss_seed=None)
    net.build()                      # namespaces and the bridge
    net.set_link(parse_link("1gbit"))
    net.cut_link(1)                  # node 1's packets vanish
    net.down()
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from ..errors import UsageError
from ..log import CONSOLE
from .linkspec import LinkSpec, tbf_args

log = logging.getLogger(__name__)

NETNS_ETC = "/etc/netns"
"""Where ``ip netns exec NAME`` finds the files it mounts over ``/etc`` for that namespace."""
FORWARDER_MTU = 65535
"""MTU of the nodes' TUN devices when the forwarder carries the links (delay or loss)."""


@dataclass
class Node:
    """One emulated node: its namespace, interface and address."""

    rank: int
    netns: str
    ifname: str
    addr: str
    port: str
    """The bridge port (in the switch namespace) its veth is plugged into."""


class ClusterNetwork:
    """Namespaces, bridge and shaped links of an emulated cluster's nodes.

    :meth:`build` makes the namespaces and the bridge, :meth:`set_link` the nodes' links and
    their shaping, :meth:`down` stops every process left in the namespaces and deletes them
    (safe to call twice). Every namespace it deletes is one it created.
    """

    def __init__(self, switch_ns: str, node_list: list[Node], link_spec: LinkSpec, verbose: bool = False,
                 loss_seed: int | None = None) -> None:
        self.switch_ns = switch_ns
        self.bridge = "ssbr"
        self.node_list = node_list
        self.link_spec = link_spec
        self.verbose = verbose
        self.loss_seed = loss_seed
        """Seed of the forwarder's loss draws (tests: the same packets are lost on every run); None: random."""
        self._created: list[str] = []
        self._cut: set[int] = set()
        self._forwarder: subprocess.Popen | None = None
        self._links_built: bool | None = None  # None: no node links; else whether the forwarder carries them

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run one ``ip``/``tc`` command; a failure (with ``check``) is a one-line UsageError."""
        cmd = list(args)
        if self.verbose:
            log.info("+ " + " ".join(cmd), extra=CONSOLE)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if check and proc.returncode != 0:
            msg = (proc.stderr or proc.stdout).strip()
            if "Operation not permitted" in msg or "Permission denied" in msg:
                raise UsageError(
                    f"emulated cluster: '{' '.join(cmd)}' was refused ({msg}); "
                    "it needs root or CAP_NET_ADMIN + CAP_SYS_ADMIN"
                )
            raise UsageError(f"emulated cluster: '{' '.join(cmd)}' failed: {msg}")
        return proc

    def build(self) -> None:
        """Create the namespaces (switch first) and the switch's bridge; the links are :meth:`set_link`'s."""
        self._add_netns(self.switch_ns)
        sw = self.switch_ns
        self.ip("ip", "-n", sw, "link", "add", self.bridge, "type", "bridge")
        self.ip("ip", "-n", sw, "link", "set", self.bridge, "up")
        self.ip("ip", "-n", sw, "link", "set", "lo", "up")
        for node in self.node_list:
            self._add_netns(node.netns)
            self.ip("ip", "-n", node.netns, "link", "set", "lo", "up")

    def _build_links(self, forwarder: bool) -> None:
        """The nodes' links: veths to the bridge, or TUN devices held by the forwarder."""
        if forwarder:
            self._start_forwarder()
        else:
            for node in self.node_list:
                self.ip(
                    "ip", "link", "add", "name", node.ifname, "netns", node.netns,
                    "type", "veth", "peer", "name", node.port, "netns", self.switch_ns,
                )
                self.ip("ip", "-n", self.switch_ns, "link", "set", node.port, "master", self.bridge)
                self.ip("ip", "-n", self.switch_ns, "link", "set", node.port, "up")
        for node in self.node_list:
            if forwarder:
                # 64 KiB packets keep the forwarder's packet rate (and CPU) low; see forwarder.py.
                self.ip("ip", "-n", node.netns, "link", "set", node.ifname, "mtu", str(FORWARDER_MTU))
            self.ip("ip", "-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.ifname)
            self.ip("ip", "-n", node.netns, "link", "set", node.ifname, "up")
        self._links_built = forwarder
        self._cut.clear()

    def _remove_links(self) -> None:
        if self._links_built is None:
            return
        self._stop_forwarder()  # its TUN devices vanish with it
        if not self._links_built:
            for node in self.node_list:
                self.ip("ip", "-n", node.netns, "link", "del", node.ifname, check=False)  # and its peer
        self._links_built = None

    def _start_forwarder(self) -> None:
        from . import forwarder

        nodes = [{"netns": f"/run/netns/{n.netns}", "ifname": n.ifname, "addr": n.addr} for n in self.node_list]
        # In the switch namespace, so that down() stops it with everything else there; its own
        # session, so that a Ctrl-C at the terminal reaches the launcher, which stops it last.
        self._forwarder = subprocess.Popen(
            ["ip", "netns", "exec", self.switch_ns, sys.executable, forwarder.__file__],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        answer = self._tell_forwarder({"nodes": nodes, "seed": self.loss_seed, **self._forwarder_state(self.link_spec)})
        if answer != "ready":
            raise UsageError(f"emulated cluster: the link forwarder did not start ({answer})")

    def _forwarder_state(self, spec: LinkSpec) -> dict:
        burst = int(tbf_args(spec.bits_per_s)[3]) if spec.bits_per_s else 0
        return {"rtt_s": spec.rtt_s, "loss": spec.loss, "bits_per_s": spec.bits_per_s, "burst_bytes": burst,
                "cut": sorted(self._cut)}

    def _tell_forwarder(self, state: dict, timeout_s: float = 10.0) -> str:
        """Send the forwarder its state; its one-line answer ("ready", "ok", "error: ...")."""
        proc = self._forwarder
        if proc is None or proc.poll() is not None:
            return "the forwarder is not running"
        try:
            proc.stdin.write(json.dumps(state).encode() + b"\n")
            proc.stdin.flush()
        except OSError as exc:
            return f"cannot reach the forwarder: {exc}"
        fd, answer, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout_s
        while not answer.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return f"no answer in {timeout_s:g} s"
            chunk = os.read(fd, 4096)
            if not chunk:
                return f"it exited with code {proc.wait()}"
            answer += chunk
        return answer.decode(errors="replace").strip()

    def _stop_forwarder(self) -> None:
        proc, self._forwarder = self._forwarder, None
        if proc is None:
            return
        proc.stdin.close()  # end of its stdin: it exits
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def forwarder_exit_code(self) -> int | None:
        """The link forwarder's exit code once it has exited; None while it runs, or without one."""
        return self._forwarder.poll() if self._forwarder is not None else None

    @property
    def forwarder_pid(self) -> int | None:
        """Process id of the link forwarder (None when the bridge carries the links)."""
        return self._forwarder.pid if self._forwarder is not None else None

    def forwarder_cpu_s(self) -> float:
        """CPU seconds (user + system) the link forwarder has used so far; 0.0 without one."""
        pid = self.forwarder_pid
        if pid is None:
            return 0.0
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _add_netns(self, name: str) -> None:
        self.ip("ip", "netns", "add", name)
        self._created.append(name)
        self._write_hosts(name)

    def _write_hosts(self, name: str) -> None:
        """The namespace's own ``/etc/hosts`` (``ip netns exec`` mounts ``/etc/netns/NAME/hosts``
        over it): the machine's, plus a name for every node address.

        A TCP store looks up the name of each client it accepts. Inside a namespace no DNS
        server can be reached, so the reverse lookup of a node address failed and every
        accepted connection printed c10d's "The hostname of the client socket cannot be
        retrieved. err=-3" (4 such lines at the start of every emulated 2-node run). With
        the names here the lookup is answered from the file, and a warning c10d prints on a
        real failure is still seen."""
        try:
            with open("/etc/hosts", encoding="utf-8") as fh:
                base = fh.read()
        except OSError:
            base = ""
        # Both spellings: the store listens on an IPv6 socket, so it sees an IPv4 client as
        # ::ffff:198.18.x.y, which glibc does not find under the IPv4 line.
        lines = [f"{addr}\t{node.netns}" for node in self.node_list for addr in (node.addr, f"::ffff:{node.addr}")]
        directory = os.path.join(NETNS_ETC, name)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "hosts"), "w", encoding="utf-8") as fh:
            fh.write(base.rstrip("\n") + "\n# slipstream emulated cluster: its nodes\n" + "\n".join(lines) + "\n")

    def down(self) -> None:
        """Stop every process left in the namespaces and delete them; safe to call twice."""
        for name in reversed(self._created):
            if name == self.switch_ns:
                self._stop_forwarder()  # the nodes' processes are stopped by now (created after the switch)
            self._kill_netns_pids(name)
        self._stop_forwarder()
        self._links_built = None
        for name in reversed(self._created):
            self.ip("ip", "netns", "del", name, check=False)
            shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)  # ip netns del leaves it
        self._created.clear()

    def netns_pids(self, name: str) -> list[str]:
        """Process ids (as ``ip netns pids`` prints them) of every process in namespace ``name``."""
        return self.ip("ip", "netns", "pids", name, check=False).stdout.split()

    def _kill_netns_pids(self, name: str) -> None:
        # Only processes inside a namespace this object created: ours by construction.
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.netns_pids(name)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(int(pid), sig)
                except (ProcessLookupError, ValueError):
                    pass
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and self.netns_pids(name):
                time.sleep(0.05)

    @property
    def namespaces(self) -> list[str]:
        """Names of this cluster's namespaces (switch first)."""
        return [self.switch_ns] + [n.netns for n in self.node_list]

    # -- links -------------------------------------------------------------------

    def set_link(self, spec: LinkSpec) -> None:
        """Set every node's link to ``spec`` (no rate: no shaping).

        A rate alone is shaped by tbf on both ends of each node's veth (the
        bridge). With a round trip or a loss, the forwarder carries the packets
        instead and tbf shapes each node's egress on its TUN device. Going from
        one kind to the other rebuilds the nodes' links (a cut link is restored).
        """
        if self._links_built != spec.needs_forwarder:
            self._remove_links()
            self.link_spec = spec
            self._build_links(spec.needs_forwarder)
        devices = [(n.netns, n.ifname) for n in self.node_list]
        if not spec.needs_forwarder:
            devices += [(self.switch_ns, n.port) for n in self.node_list]
        for ns, dev in devices:
            self.ip("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
            if spec.bits_per_s is not None:
                self.ip("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", *tbf_args(spec.bits_per_s))
        if spec.needs_forwarder:
            self._update_forwarder(spec)
        self.link_spec = spec

    def _update_forwarder(self, spec: LinkSpec) -> dict[str, int]:
        answer = self._tell_forwarder(self._forwarder_state(spec))
        if answer.split(" ", 1)[0] != "ok":
            raise UsageError(f"emulated cluster: the link forwarder refused its settings ({answer})")
        return json.loads(answer.split(" ", 1)[1]) if " " in answer else {}

    def forwarder_counts(self) -> dict[str, int]:
        """Packets the link forwarder has handled so far, by fate (``forwarded``, ``lost``, ...); {} without one."""
        return self._update_forwarder(self.link_spec) if self._links_built else {}

    def cut_link(self, node: int) -> None:
        """Partition node ``node`` away: its port leaves the bridge, its packets vanish.

        The port and the node's interface stay up (no carrier loss), as when a
        switch or a route fails: the node's TCP connections see silence, not an
        error. (Setting the bridge port's STP state to disabled is silently
        undone by the kernel when STP is off, and tc drop actions are not in
        every kernel, ours included; unplugging the port from the bridge works
        everywhere.)
        """
        self._cut.add(node)
        if self._links_built:
            self._update_forwarder(self.link_spec)  # the forwarder drops the node's packets
            return
        port = self.node_list[node].port
        self.ip("ip", "-n", self.switch_ns, "link", "set", "dev", port, "nomaster")

    def restore_link(self, node: int) -> None:
        """Undo :meth:`cut_link`: the port joins the bridge again and forwards at once (STP is off)."""
        self._cut.discard(node)
        if self._links_built:
            self._update_forwarder(self.link_spec)
            return
        port = self.node_list[node].port
        self.ip("ip", "-n", self.switch_ns, "link", "set", "dev", port, "master", self.bridge)

    def tx_bytes(self, node: int, ifname: str | None = None) -> int:
        """Bytes sent so far by ``node`` on its shaped interface (or ``ifname``, e.g. ``lo``)."""
        n = self.node_list[node]
        out = self.ip("ip", "netns", "exec", n.netns, "cat", f"/sys/class/net/{ifname or n.ifname}/statistics/tx_bytes")
        return int(out.stdout.strip())
