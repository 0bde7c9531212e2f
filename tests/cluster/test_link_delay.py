"""Links with a round trip and loss (``--link RATE,RTT,LOSS``): the forwarder, measured (root).

As the rate shaping was validated: the round trip two nodes see (TCP ping-pong,
median), the bus bandwidth of a gloo all-reduce against the rate, the latency
``auto``'s probe fits, a TCP transfer through 1% loss, and cleanup of the
forwarder and its devices on SIGTERM. One cluster serves the first three.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slipstream.launch import emulate
from slipstream.launch.emulate import EmulatedCluster, list_namespaces
from tests.cluster.test_emulate import PROBE, ROOT, _processes_with
from tests.conftest import require_root

pytestmark = pytest.mark.root

HERE = Path(__file__).parent
PINGPONG = str(HERE / "scripts_pingpong.py")
ALLREDUCE = str(HERE / "scripts_allreduce_bw.py")
RTT_S = 0.02
LINK = f"100mbit,{RTT_S * 1e3:g}ms"


@pytest.fixture(scope="module")
def cluster():
    require_root()
    prefix = f"sst{secrets.token_hex(2)}-"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(emulate, "NS_PREFIX", prefix)
        # Seed 1: the 14th, 92nd and 180th loss draws lose their packet, so a transfer of a few hundred
        # packets loses at least two on every run (no flaky zero).
        with EmulatedCluster(2, link=LINK, loss_seed=1) as c:
            yield c
        assert list_namespaces(prefix) == []


def _server(cluster: EmulatedCluster, node: int, mode: str, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cluster.exec_argv(node, [sys.executable, PINGPONG, mode, cluster.node_list[node].addr,
                                                     str(port)]), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


def test_round_trip_between_nodes_is_the_set_one(cluster):
    """TCP ping-pong of 32-byte messages, 120 samples: the median is the set round trip, within 10%."""
    assert cluster.forwarder_pid is not None and cluster.link == LINK
    server = _server(cluster, 1, "serve", 29555)
    try:
        cpu0 = cluster.forwarder_cpu_s()
        r = subprocess.run(cluster.exec_argv(0, [sys.executable, PINGPONG, "ping", cluster.node_list[1].addr, "29555",
                                                 "120"]), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    finally:
        server.kill()
        server.wait()
    median_s = float(r.stdout)
    print(f"round trip: set {RTT_S * 1e3:g} ms, measured median {median_s * 1e3:.2f} ms; "
          f"forwarder CPU {cluster.forwarder_cpu_s() - cpu0:.2f} s")
    assert 0.9 * RTT_S <= median_s <= 1.1 * RTT_S


def test_allreduce_bus_bandwidth_and_the_probed_latency(cluster, tmp_path):
    """gloo all-reduce of 8 MiB at 100 Mbit/s with 20 ms round trip: busbw within 0.8-1.05 of the rate,
    and auto's probe sees the round trip (gloo pays about one round trip per ring step)."""
    out = tmp_path / "bw.json"
    addr = cluster.node_list[0].addr
    procs = [subprocess.Popen(cluster.exec_argv(i, [sys.executable, ALLREDUCE, addr, "29600", str(i), "2", "8", "3",
                                                    str(out)]),
                              env=cluster.node_env(i), stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0], [p.stderr.read()[-2000:] for p in procs]
    r = json.loads(out.read_text())
    ratio = r["busbw_bytes_per_s"] * 8 / cluster.link_bits_per_s
    print(f"busbw / link = {ratio:.3f}; probe: alpha {r['probe_alpha_s'] * 1e3:.1f} ms, "
          f"hop {r['probe_hop_latency_s'] * 1e3:.1f} ms, {r['probe_bytes_per_s'] * 8 / 1e6:.1f} Mbit/s")
    assert r["sum_ok"]
    assert 0.8 <= ratio <= 1.05
    assert 0.8 * RTT_S <= r["probe_hop_latency_s"] <= 1.5 * RTT_S


def test_tcp_transfer_completes_through_one_percent_loss(cluster):
    cluster.set_link("100mbit,4ms,1%")
    try:
        before = cluster.forwarder_counts()
        sink = _server(cluster, 1, "sink", 29556)
        try:
            sent = subprocess.run(cluster.exec_argv(0, [sys.executable, PINGPONG, "send", cluster.node_list[1].addr,
                                                        "29556", "8", "7"]), capture_output=True, text=True, timeout=60)
            received = sink.communicate(timeout=60)[0]
        finally:
            sink.kill()
            sink.wait()
        assert sent.returncode == 0, sent.stderr
        assert received.split()[:2] == sent.stdout.split()  # same sha256, same length
        after = cluster.forwarder_counts()
        lost = after.get("lost", 0) - before.get("lost", 0)
        forwarded = after["forwarded"] - before.get("forwarded", 0)
        print(f"1% loss: {lost} of {lost + forwarded} packets lost, transfer intact")
        assert lost >= 2
        assert lost / (lost + forwarded) < 0.05
    finally:
        cluster.set_link(LINK)


def test_cut_link_silences_a_node_behind_the_forwarder(cluster):
    cluster.cut_link(1)
    r = subprocess.run(cluster.exec_argv(0, [sys.executable, "-c",
                                             f"import socket; socket.create_connection(('{cluster.node_list[1].addr}', "
                                             "29557), timeout=1)"]), capture_output=True, text=True, timeout=30)
    assert "timed out" in r.stderr  # silence, not a refusal: the packets vanished
    cluster.restore_link(1)
    r = subprocess.run(cluster.exec_argv(0, [sys.executable, "-c",
                                             f"import socket; socket.create_connection(('{cluster.node_list[1].addr}', "
                                             "29557), timeout=5)"]), capture_output=True, text=True, timeout=30)
    assert "Connection refused" in r.stderr  # node 1 answers again (nothing listens on the port)


def test_sigterm_stops_the_forwarder_and_removes_its_devices(tmp_path, monkeypatch):
    """SIGTERM to `slipstream run` while the nodes' agents start: exit 130, forwarder gone, nothing left."""
    require_root()
    prefix = f"sst{secrets.token_hex(2)}-"
    monkeypatch.setenv("SLIPSTREAM_EMULATE_NS_PREFIX", prefix)
    proc = subprocess.Popen(
        [sys.executable, "-m", "slipstream", "run", "--emulate", "2x1", "--link", "1gbit,2ms,0.1%", PROBE,
         str(tmp_path), "hang"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    forwarder = str(Path(emulate.__file__).with_name("forwarder.py"))

    def pids(ns: str) -> list[int]:
        return [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                                               text=True).stdout.split()]

    try:
        deadline, names = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            names = list_namespaces(prefix)
            if len(names) == 3 and all(pids(n) for n in names):  # forwarder in the switch, agents in the nodes
                break
            time.sleep(0.1)
        switch = next(n for n in names if n.endswith("-sw"))
        ours = pids(switch)
        assert len(ours) == 1 and ours[0] in _processes_with(forwarder)  # the forwarder, alone there
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130
    assert "2 ms round trip between nodes" in proc.stderr.read()
    assert list_namespaces(prefix) == []  # and the TUN devices with them
    assert not Path(f"/proc/{ours[0]}").exists()
