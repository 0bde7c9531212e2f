"""The userspace link of an emulated cluster: round-trip delay and packet loss between nodes.

``netem`` is the kernel's tool for this, and it is missing from some kernels
(ours and our CI's among them, with ``fq``, ``prio`` and ``sfq``); no maintained
library adds delay and loss to a TUN device from Python, so this small
forwarder is written by hand. It runs as one process per emulated cluster,
inside the cluster's switch namespace, and stands in for the bridge:

* it opens one TUN device per node, inside that node's namespace (``setns``
  before ``TUNSETIFF``: a TUN device is born in the namespace of the thread
  that opens ``/dev/net/tun``), named as the node's interface (``ssn<i>``), so
  ``GLOO_SOCKET_IFNAME``, ``tx_bytes`` and the tbf on the node's egress work as
  with the bridge. The launcher gives it the node's address, a 64 KiB MTU (a
  1 Gbit/s stream is then about 2000 packets a second, which Python keeps up
  with) and the tbf;
* every IPv4 packet a node sends comes out of its device here; it is lost with
  probability ``loss``, else queued for its destination's device and written
  there at ``arrival + rtt_s / 2``, and no earlier than the destination's
  token bucket (``bits_per_s``, ``burst_bytes``: the node's ingress shaping, as
  the tbf on the bridge port did) allows. One FIFO queue per destination:
  release times only grow along a queue, so TCP is never reordered. A packet
  that would wait more than ``queue_s`` for the bucket is dropped, as tbf drops
  past its latency;
* it reads commands on stdin, one JSON object a line (the whole state: ``rtt_s``,
  ``loss``, ``bits_per_s``, ``burst_bytes``, ``cut``: node indices whose packets
  vanish), and answers each on stdout once applied: ``ok`` and its packet
  counts so far as JSON (``forwarded``, ``lost``, ...). The first line
  also names the nodes; the answer to it is ``ready`` once their devices exist,
  or ``error: ...``. End of stdin (the launcher closed it, or died) ends the
  forwarder, and its devices vanish with it (they are not persistent).

Standard library only, and runnable by path, so the launcher can start it in
any namespace with the same interpreter.

Example (what :class:`~slipstream.launch.emulate.EmulatedCluster` sends)::

    {"nodes": [{"netns": "/run/netns/ss-ab12-n0", "ifname": "ssn0", "addr": "198.18.7.1"}, ...],
     "rtt_s": 0.04, "loss": 0.001, "bits_per_s": 100000000, "burst_bytes": 131072, "cut": []}
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
PR_SET_TIMERSLACK = 29
READ_BYTES = 1 << 16
"""Larger than the devices' MTU (65535): one read is one packet."""
READS_PER_WAKE = 64
"""Packets read from one device before the others get a turn."""


def open_tun(netns_path: str, ifname: str) -> int:
    """A non-blocking TUN device ``ifname`` (IP packets, no header) created in the namespace at ``netns_path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(netns_path, os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns_path}")
        try:
            fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
            try:
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", ifname.encode(), IFF_TUN | IFF_NO_PI))
            except OSError:
                os.close(fd)
                raise
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back into the forwarder's namespace")
    finally:
        os.close(own)
        os.close(target)
    return fd


class Forwarder:
    """Packets between the nodes' TUN devices, delayed, thinned and paced (see the module docstring)."""

    def __init__(self, fds: list[int], addrs: list[str], seed: int | None = None) -> None:
        self.fds = fds
        self.index = {socket.inet_aton(a): i for i, a in enumerate(addrs)}
        self.queues: list[collections.deque] = [collections.deque() for _ in fds]
        self.tat = [0.0] * len(fds)  # per destination: the token bucket's theoretical arrival time (GCRA)
        self.random = random.Random(seed)
        self.half_rtt_s = 0.0
        self.loss = 0.0
        self.bits_per_s: float | None = None
        self.burst_s = 0.0
        self.queue_s = 0.1
        self.cut: set[int] = set()
        self.counts = collections.Counter()

    def configure(self, state: dict) -> None:
        self.half_rtt_s = float(state.get("rtt_s", 0.0)) / 2
        self.loss = float(state.get("loss", 0.0))
        bits = state.get("bits_per_s")
        self.bits_per_s = float(bits) if bits else None
        self.burst_s = float(state.get("burst_bytes", 0)) * 8 / self.bits_per_s if self.bits_per_s else 0.0
        self.queue_s = float(state.get("queue_s", 0.1))
        self.cut = {int(i) for i in state.get("cut", ())}

    def accept(self, src: int, packet: bytes, now: float) -> None:
        """Queue one packet read from node ``src`` (or drop it)."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            self.counts["not_ipv4"] += 1
            return
        dst = self.index.get(packet[16:20])
        if dst is None or dst == src or src in self.cut or dst in self.cut:
            self.counts["unroutable_or_cut"] += 1
            return
        if self.loss and self.random.random() < self.loss:
            self.counts["lost"] += 1
            return
        release = now + self.half_rtt_s
        if self.bits_per_s:
            # GCRA: the destination's bucket holds burst_s of traffic; a packet goes when it fits.
            release = max(release, self.tat[dst] - self.burst_s)
            if release - now - self.half_rtt_s > self.queue_s:
                self.counts["queue_full"] += 1
                return
            self.tat[dst] = max(release, self.tat[dst]) + len(packet) * 8 / self.bits_per_s
        self.queues[dst].append((release, packet))

    def release_due(self, now: float) -> float | None:
        """Write every packet whose time has come; seconds until the next one (None: queues empty)."""
        wait = None
        for dst, queue in enumerate(self.queues):
            while queue and queue[0][0] <= now:
                packet = queue.popleft()[1]
                try:
                    os.write(self.fds[dst], packet)
                    self.counts["forwarded"] += 1
                except OSError:  # the device is down, or its backlog full: the packet is lost
                    self.counts["write_failed"] += 1
            if queue:
                due = queue[0][0] - now
                wait = due if wait is None else min(wait, due)
        return wait

    def serve(self, control: int) -> int:
        """Forward until ``control`` reaches end of file; 0."""
        readable = [control, *self.fds]
        node_of = {fd: i for i, fd in enumerate(self.fds)}
        pending = b""
        while True:
            wait = self.release_due(time.monotonic())
            ready, _, _ = select.select(readable, [], [], wait)
            now = time.monotonic()
            for fd in ready:
                if fd == control:
                    data = os.read(control, 65536)
                    if not data:
                        return 0
                    pending += data
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        try:
                            self.configure(json.loads(line))
                        except (ValueError, TypeError, AttributeError) as exc:
                            reply(f"error: {exc}".replace("\n", " ").encode())
                            continue
                        reply(b"ok " + json.dumps(self.counts).encode())
                    continue
                src = node_of[fd]
                for _ in range(READS_PER_WAKE):
                    try:
                        packet = os.read(fd, READ_BYTES)
                    except BlockingIOError:
                        break
                    self.accept(src, packet, now)


def reply(line: bytes) -> None:
    os.write(1, line + b"\n")


def read_line(fd: int) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return data


def main() -> int:
    # Ctrl-C at a terminal is the launcher's to handle: it stops the nodes, then closes our stdin.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Wake on time: the default 50 us timer slack would add up to 0.1 ms to every round trip.
    ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    try:
        first = json.loads(read_line(0) or b"null")
        if not isinstance(first, dict) or not first.get("nodes"):
            raise ValueError("the first line must be a JSON object with 'nodes'")
        fds = [open_tun(n["netns"], n["ifname"]) for n in first["nodes"]]
        forwarder = Forwarder(fds, [n["addr"] for n in first["nodes"]], first.get("seed"))
        forwarder.configure(first)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reply(f"error: {exc}".replace("\n", " ").encode())
        return 1
    reply(b"ready")
    return forwarder.serve(0)


if __name__ == "__main__":
    sys.exit(main())
