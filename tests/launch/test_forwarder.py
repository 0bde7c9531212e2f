"""The link forwarder's logic (slipstream.launch.forwarder), over pipes instead of TUN devices (no root).

Its TUN devices, delay and loss between real namespaces are measured in
tests/cluster/test_link_delay.py.
"""

from __future__ import annotations

import os
import socket
import struct

import pytest

from slipstream.launch.forwarder import Forwarder

ADDRS = ["198.18.9.1", "198.18.9.2", "198.18.9.3"]


def packet(dst: int, size: int = 100, tag: int = 0) -> bytes:
    """An IPv4 header to ADDRS[dst], padded to ``size`` bytes; ``tag`` in the identification field."""
    header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, size, tag, 0, 64, 6, 0, socket.inet_aton("198.18.9.250"),
                         socket.inet_aton(ADDRS[dst]))
    return header + bytes(size - len(header))


@pytest.fixture
def pipes():
    """One pipe per node: the forwarder writes node i's packets to pipes[i][1]; the test reads pipes[i][0]."""
    made = [os.pipe() for _ in ADDRS]
    for r, _ in made:
        os.set_blocking(r, False)
    yield made
    for r, w in made:
        os.close(r)
        os.close(w)


def received(pipes, node: int) -> list[int]:
    """Tags of the packets written to ``node`` so far (each packet is 100 bytes)."""
    try:
        data = os.read(pipes[node][0], 1 << 20)
    except BlockingIOError:
        return []
    return [struct.unpack("!H", data[i + 4:i + 6])[0] for i in range(0, len(data), 100)]


def test_packets_wait_half_the_round_trip_and_keep_their_order(pipes):
    f = Forwarder([w for _, w in pipes], ADDRS)
    f.configure({"rtt_s": 0.04})
    for tag in range(5):
        f.accept(0, packet(1, tag=tag), now=10.0 + tag * 0.001)
    f.accept(0, packet(2, tag=9), now=10.0)
    assert f.release_due(10.019) == pytest.approx(0.001) and received(pipes, 1) == []
    f.release_due(10.0205)
    assert received(pipes, 1) == [0] and received(pipes, 2) == [9]
    assert f.release_due(10.03) is None
    assert received(pipes, 1) == [1, 2, 3, 4]


def test_loss_drops_the_set_fraction(pipes):
    f = Forwarder([w for _, w in pipes], ADDRS, seed=1)
    f.configure({"loss": 0.1})
    for tag in range(2000):
        f.accept(0, packet(1, tag=tag), now=0.0)
        f.release_due(0.0)
        received(pipes, 1)  # keep the pipe from filling
    assert 150 <= f.counts["lost"] <= 250 and f.counts["lost"] + f.counts["forwarded"] == 2000


def test_the_destination_bucket_paces_to_the_rate_and_drops_past_its_queue(pipes):
    f = Forwarder([w for _, w in pipes], ADDRS)
    # 8 Mbit/s = 1 MB/s; a burst of 1000 bytes; 100-byte packets: 1 every 0.1 ms after the burst
    f.configure({"bits_per_s": 8e6, "burst_bytes": 1000, "queue_s": 0.01005})
    for tag in range(120):
        f.accept(0, packet(1, tag=tag), now=0.0)
    releases = [t for t, _ in f.queues[1]]
    assert releases[:11] == pytest.approx([0.0] * 11, abs=1e-12)  # the burst goes at once
    assert releases[20] == pytest.approx(0.001) and releases[-1] == pytest.approx(0.010)
    assert len(releases) == 111 and f.counts["queue_full"] == 9  # queued past 10 ms: dropped, as tbf does


def test_cut_nodes_unknown_addresses_and_non_ipv4_are_dropped(pipes):
    f = Forwarder([w for _, w in pipes], ADDRS)
    f.configure({"cut": [2]})
    f.accept(0, packet(2), now=0.0)         # to a cut node
    f.accept(2, packet(1), now=0.0)         # from a cut node
    f.accept(0, packet(0), now=0.0)         # to itself
    f.accept(0, b"\x60" + bytes(59), now=0.0)  # IPv6
    f.accept(0, packet(1, tag=5), now=0.0)
    f.release_due(0.0)
    assert received(pipes, 1) == [5] and received(pipes, 2) == [] and received(pipes, 0) == []
    assert f.counts["unroutable_or_cut"] == 3 and f.counts["not_ipv4"] == 1
