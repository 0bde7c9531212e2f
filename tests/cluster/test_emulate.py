"""The emulated cluster for real: namespaces, shaped links, partitions, agents, cleanup (root).

No timings are asserted: only that the cluster is built as documented, runs a
job across nodes, reports its exit code, and leaves nothing behind.
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

from slipstream.launch import LaunchOptions, emulate
from slipstream.launch.emulate import EmulatedCluster, list_namespaces
from slipstream.launch.emulate_job import run_emulated
from tests.conftest import require_root

pytestmark = pytest.mark.root


@pytest.fixture(autouse=True)
def own_prefix(monkeypatch):
    """Namespaces of this test only, so runs going on beside it do not confuse the checks."""
    prefix = f"sst{secrets.token_hex(2)}-"
    monkeypatch.setattr(emulate, "NS_PREFIX", prefix)
    monkeypatch.setenv("SLIPSTREAM_EMULATE_NS_PREFIX", prefix)
    return prefix


PROBE = str(Path(__file__).with_name("scripts_probe.py"))
ROOT = Path(__file__).resolve().parents[2]


def _links_in(ns: str) -> str:
    return subprocess.run(["ip", "-n", ns, "-o", "link"], capture_output=True, text=True).stdout


def _tcp_ok(cluster: EmulatedCluster, src: int, dst: int, timeout_s: float = 1.5) -> bool:
    """Connect from node src to a listener in node dst (both ours)."""
    addr = cluster.node_list[dst].addr
    server = subprocess.Popen(
        cluster.exec_argv(dst, [sys.executable, "-c",
                                "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
                                f"s.bind(('{addr}', 29555)); s.listen(); print('up', flush=True); s.settimeout(10); "
                                "c,_=s.accept(); c.sendall(b'pong')"]),
        stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        client = subprocess.run(
            cluster.exec_argv(src, [sys.executable, "-c",
                                    f"import socket; c=socket.create_connection(('{addr}', 29555), timeout={timeout_s}); "
                                    "print(c.recv(4).decode())"]),
            capture_output=True, text=True, timeout=30)
        return client.returncode == 0 and client.stdout.strip() == "pong"
    finally:
        server.kill()
        server.wait()


def test_cluster_is_built_shaped_partitionable_and_removed():
    require_root()
    with EmulatedCluster(2, link="200mbit") as a, EmulatedCluster(2, link="unshaped") as b:
        # two clusters coexist, with distinct names
        assert set(a.namespaces).isdisjoint(b.namespaces)
        assert set(a.namespaces) | set(b.namespaces) <= set(list_namespaces())
        # a bridge in the switch namespace, one veth per node, node ends addressed
        assert "ssbr" in _links_in(a.switch_ns) and "ssp0" in _links_in(a.switch_ns) and "ssp1" in _links_in(a.switch_ns)
        for node in a.node_list:
            addrs = subprocess.run(["ip", "-n", node.netns, "-o", "addr"], capture_output=True, text=True).stdout
            assert f"{node.addr}/24" in addrs and node.ifname in addrs
            # tbf on both ends: node egress, and the switch port's egress (= node ingress)
            for ns, dev in ((node.netns, node.ifname), (a.switch_ns, node.port)):
                q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
                assert "tbf" in q and "200Mbit" in q, q
        for node in b.node_list:
            q = subprocess.run(["tc", "-n", node.netns, "qdisc", "show", "dev", node.ifname], capture_output=True, text=True).stdout
            assert "tbf" not in q
        # reshaping in place
        a.set_link("1gbit")
        q = subprocess.run(["tc", "-n", a.switch_ns, "qdisc", "show", "dev", "ssp1"], capture_output=True, text=True).stdout
        assert "1Gbit" in q
        # traffic flows, a cut link stops it, a restored link carries it again
        sent = a.tx_bytes(0)
        assert _tcp_ok(a, 0, 1)
        assert a.tx_bytes(0) > sent
        a.cut_link(1)
        assert not _tcp_ok(a, 0, 1)
        a.restore_link(1)
        assert _tcp_ok(a, 0, 1)
        # clusters are isolated from each other: same 198.18 range, no route between
        assert not _tcp_ok_between(a, b)
        # a node's address has a name in every namespace (a TCP store's reverse lookup of a client
        # is answered from /etc/hosts, not by a DNS server no namespace reaches), both spellings
        peer = a.node_list[1].addr
        lookup = subprocess.run(a.exec_argv(0, [sys.executable, "-c", "import socket; print(*(socket.getnameinfo("
                                                f"(h, 1), socket.NI_NAMEREQD)[0] for h in ('{peer}', '::ffff:{peer}')))"]),
                                capture_output=True, text=True, timeout=30)
        assert lookup.stdout.split() == [a.node_list[1].netns] * 2, lookup
        names = a.namespaces + b.namespaces
    assert list_namespaces() == []
    assert not set(names) & set(list_namespaces())
    assert not any(Path(emulate.NETNS_ETC, name).exists() for name in names)  # their /etc/netns files too


def _tcp_ok_between(a: EmulatedCluster, b: EmulatedCluster) -> bool:
    r = subprocess.run(
        a.exec_argv(0, [sys.executable, "-c",
                        f"import socket; socket.create_connection(('{b.node_list[0].addr}', 29400), timeout=1)"]),
        capture_output=True, text=True, timeout=30)
    return r.returncode == 0


def test_run_emulated_2x2_reduces_across_nodes_and_keeps_intra_node_traffic_on_loopback(tmp_path):
    require_root()
    code = run_emulated(2, 2, "1gbit", LaunchOptions(PROBE, [str(tmp_path)]))
    assert code == 0
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["world"] == 4 and r["sum"] == 1 + 2 + 3 + 4 for r in reports)
    assert {r["node"] for r in reports} == {0, 1}
    assert all(r["ifname"] == f"ssn{r['node']}" for r in reports)
    assert [r["node"] for r in sorted(reports, key=lambda r: r["rank"])] == [0, 0, 1, 1]
    # 4 MiB all-reduce over a 4-rank ring: each rank sends 2*3/4*4 MiB = 6 MiB; half of the
    # ring's hops stay inside a node (loopback), half cross the shaped link.
    mib = 2**20
    for r in reports:
        assert 5 * mib <= r["if_bytes"] <= 9 * mib, r
        assert 5 * mib <= r["lo_bytes"] <= 9 * mib, r
    assert list_namespaces() == []


def test_a_successful_emulated_run_prints_its_summary_and_run_directory_last_and_no_warning(tmp_path):
    """Issue #46 item 4: no c10d hostname warnings at start, no store error or native stack trace
    after the end; the launcher's summary and the run directory are the last lines."""
    require_root()
    from tests.launch.test_summary import check_quiet_success, readme_script

    script = tmp_path / "train.py"
    script.write_text(readme_script(steps=20))
    run_dir = tmp_path / "runs" / "r"
    proc = subprocess.run([sys.executable, "-m", "slipstream", "run", "--emulate", "2x1", "--link", "1gbit",
                           "--run-dir", str(run_dir), str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    check_quiet_success(proc, run_dir, steps=20, ranks=2)
    assert list_namespaces() == []


def test_failure_is_propagated_and_cleaned_up(tmp_path):
    require_root()
    t0 = time.monotonic()
    code = run_emulated(2, 1, "unshaped", LaunchOptions(PROBE, [str(tmp_path), "fail"]))
    assert code == 1
    assert time.monotonic() - t0 < 90
    assert list_namespaces() == []


def test_a_configuration_error_exits_2_with_its_message(tmp_path):
    """Issue #22: on the emulated cluster too, a worker's ConfigError ends `slipstream run`
    with exit 2 and its message, no restart spent, nothing left behind."""
    require_root()
    script = str(ROOT / "tests" / "integration" / "scripts_config_error.py")
    r = subprocess.run(
        [sys.executable, "-m", "slipstream", "run", "--emulate", "2x1", "--max-restarts", "1", script,
         "--marker", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    report = r.stderr.split("slipstream run: configuration error in")[-1]
    assert "slipstream: error (rank " in report and "checkpoint_dir exists and is not a directory" in report
    assert "training failed" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["start-rank0-attempt0", "start-rank1-attempt0"]
    assert list_namespaces() == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_removes_everything(tmp_path, sig):
    require_root()
    proc = subprocess.Popen(
        [sys.executable, "-m", "slipstream", "run", "--emulate", "2x1", "--link", "1gbit", PROBE, str(tmp_path), "hang"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # a background process starts with SIGINT ignored; give it the terminal's default
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not all((tmp_path / f"started{r}").exists() for r in range(2)):
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        assert all((tmp_path / f"started{r}").exists() for r in range(2))
        ours = set(list_namespaces())
        assert len(ours) == 3  # switch + 2 nodes
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130
    assert "emulated cluster removed" in proc.stderr.read()
    assert list_namespaces() == []
    assert _processes_with(f"{PROBE}\0{tmp_path}") == []


def _processes_with(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (NUL-separated arguments), read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_refused_without_privileges(tmp_path):
    require_root()  # needs root to drop its capabilities
    # Root with an empty bounding set: exec leaves it no capabilities (as in an unprivileged container).
    r = subprocess.run(
        ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--",
         sys.executable, "-m", "slipstream", "run", "--emulate", "2x1", PROBE, str(tmp_path)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert r.returncode == 2, r.stderr
    assert "--emulate cannot build a cluster here" in r.stderr and "CAP_NET_ADMIN" in r.stderr
    assert "Traceback" not in r.stderr
    assert list_namespaces() == []
