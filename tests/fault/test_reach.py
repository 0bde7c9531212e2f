"""The reachability probe behind the hang report's "cut off from the network"."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from slipstream.fault import progress, reach
from tests.conftest import need_command, require_root


def test_a_listening_port_and_a_closed_one_both_answer():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert reach.answers("127.0.0.1", server.getsockname()[1]) is True
        closed = server.getsockname()[1]
    assert reach.answers("127.0.0.1", closed) is True  # refused: the host is up


def test_an_address_behind_no_route_does_not_answer(tmp_path):
    """In a network namespace of its own with only loopback (this machine's host network may
    hand any connect to a proxy that accepts it, so the probe runs where the route is known)."""
    require_root("needs root (a network namespace)")
    need_command("ip")
    ns = f"ss-reach-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        code = ("from slipstream.fault import reach; "
                "print(reach.answers('198.18.255.254', 29500, timeout_s=0.5), reach.answers('127.0.0.1', 9))")
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def test_the_local_address_on_the_route_to_a_host():
    assert reach.local_address_toward("127.0.0.1") == "127.0.0.1"


def test_a_silent_peer_is_named_cut_off_and_a_refusing_one_gone(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29500")
    record = {"node": "1", "addr": "198.18.0.2"}
    monkeypatch.setattr(reach, "answers", lambda host, port, timeout_s=2.0: False)
    assert "198.18.0.2 does not answer: its node is cut off" in progress._why_silent(record)
    monkeypatch.setattr(reach, "answers", lambda host, port, timeout_s=2.0: True)
    assert "answers: the process is gone or frozen" in progress._why_silent(record)
    assert progress._node_text(record) == " (node 1, 198.18.0.2)"
    assert progress._why_silent(None) == "process gone or frozen"
    assert progress._node_text({"node": "0", "addr": "127.0.0.1"}) == " (node 0)"  # one machine: no address


def test_a_rank_that_cannot_reach_the_store_says_its_node_is_cut_off(monkeypatch, tmp_path):
    monkeypatch.setenv("MASTER_ADDR", "198.18.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setattr(reach, "answers", lambda host, port, timeout_s=2.0: False)
    reporter = progress.ProgressReporter(1, 2, store=None, progress_dir=str(tmp_path / "progress"))
    reporter.mark(progress.BACKWARD, step=12)
    error = progress.diagnose_hang(reporter, RuntimeError("Timed out waiting 10000ms for recv"), 10.0, str(tmp_path))
    text = str(error)
    assert "rank 1 (node 1" in text and "cannot reach the rendezvous store at 198.18.0.1:29400" in text
    assert "cut off from the others" in (tmp_path / "hang.txt").read_text()
