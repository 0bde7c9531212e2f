"""The rendezvous store outlives its clients at the end of a successful run (issue #46 item 4).

Two agents on loopback, node 0 hosting the c10d rendezvous store. The other node is made slow
to close the rendezvous (a sitecustomize on its PYTHONPATH delays torch's shutdown()), as a
loaded machine makes it: before the fix node 0 exited at once, its store with it, and node 1
printed "recvVector failed ... Did the remote server shutdown or crash?", "failed to shutdown
the rendezvous" and a native stack trace after a run that succeeded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

from slipstream.launch.agent import LEFT_KEY, _ClosingInOrder, say_left, wait_for_clients
from tests.harness import free_port

SLOW_CLOSE = """\
import time
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as _dr

_shutdown = _dr.DynamicRendezvousHandler.shutdown


def _slow_shutdown(self):
    time.sleep(1.5)  # the node closes after the store's host would have exited
    return _shutdown(self)


_dr.DynamicRendezvousHandler.shutdown = _slow_shutdown
"""


def test_the_store_host_waits_until_the_other_node_has_closed(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('trained', flush=True)\n")
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW_CLOSE)
    port = free_port()

    def agent(node: int, extra_env: dict[str, str]) -> subprocess.Popen:
        argv = [sys.executable, "-m", "slipstream", "run", "--nnodes", "2", "--node-rank", str(node),
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "exit-order", "-n", "1", str(script)]
        env = {**os.environ, "SLIPSTREAM_RUN_DIR": str(tmp_path / "run"), **extra_env}
        return subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    host = agent(0, {})
    other = agent(1, {"PYTHONPATH": os.pathsep.join([str(slow), os.environ.get("PYTHONPATH", "")])})
    outputs = [p.communicate(timeout=240) for p in (host, other)]
    assert [host.returncode, other.returncode] == [0, 0], outputs
    for out, err in outputs:
        assert out.count("trained") == 1
        for noise in ("failed to shutdown the rendezvous", "recvVector", "RendezvousConnectionError", "Traceback"):
            assert noise not in err, err[-3000:]


def _store():
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_wait_for_clients_returns_once_every_other_node_said_it_left():
    store = _store()
    left_at: list[float] = []

    def other_node() -> None:
        time.sleep(0.3)
        left_at.append(time.monotonic())
        say_left(store)

    thread = threading.Thread(target=other_node)
    thread.start()
    assert wait_for_clients(store, clients=1, timeout_s=10.0)
    done_at = time.monotonic()
    thread.join()
    assert left_at and done_at >= left_at[0]
    assert not wait_for_clients(store, clients=2, timeout_s=0.1)  # one node never says it: the wait is bounded


class _Group:
    def __init__(self, state: str, size: int) -> None:
        self.state = type("State", (), {"name": state})()
        self.group_world_size = size


class _Handler:
    def __init__(self) -> None:
        self.closed = 0

    def shutdown(self) -> bool:
        self.closed += 1
        return True


def test_only_a_successful_run_orders_the_exit():
    store = _store()
    agent = type("Agent", (), {})()
    agent._store, agent._worker_group = store, _Group("SUCCEEDED", 2)
    handler = _Handler()
    assert _ClosingInOrder(handler, agent, is_store_host=False).shutdown()
    assert int(store.add(LEFT_KEY, 0)) == 1 and handler.closed == 1  # closed first, then its last word
    agent._worker_group = _Group("FAILED", 3)  # after a failure a node may be gone: the host does not wait
    started = time.monotonic()
    assert _ClosingInOrder(handler, agent, is_store_host=True).shutdown()
    assert time.monotonic() - started < 1.0
