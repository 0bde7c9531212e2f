"""A lost emulated node coming back healing (slipstream.launch.node_rejoin) and the record of its
workers its agent writes (slipstream.launch.agent.record_workers): no root, no training; the whole
node loss is tests/integration/test_heal_node_loss.py."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
from torch.distributed.elastic.utils import store as store_util

from slipstream.launch import agent, node_rejoin
from slipstream.launch.parent_death import ENV_AGENT_PID
from slipstream.resilience import heal_env


def test_the_record_holds_a_worker_started_a_moment_ago(tmp_path):
    # Popen returns before the kernel lays out the child's new command line (vfork): read at once,
    # it was empty, and the node could not come back.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)", "arg"], env={"A": "1", "B": "x=y"},
                            cwd=tmp_path)
    try:
        agent.record_workers(str(tmp_path / "n1.json"), {0: proc.pid}, {"prefix": "p", "nodes": 2})
    finally:
        proc.kill()
        proc.wait()
    record = node_rejoin.load(str(tmp_path / "n1.json"))
    assert record is not None
    (worker,) = record["workers"]
    assert worker["argv"] == [sys.executable, "-c", "import time; time.sleep(5)", "arg"]
    assert worker["env"] == {"A": "1", "B": "x=y"} and worker["cwd"] == str(tmp_path)
    assert record["store"] == {"prefix": "p", "nodes": 2}


def test_a_record_that_cannot_stand_in_for_the_node_is_none(tmp_path):
    path = tmp_path / "n.json"
    assert node_rejoin.load(str(path)) is None  # none written: the node never started its workers
    path.write_text(json.dumps({"workers": [], "store": {"prefix": "p", "nodes": 2}}))
    assert node_rejoin.load(str(path)) is None
    path.write_text(json.dumps({"workers": [{"argv": ["x"], "env": {}, "cwd": "/"}], "store": None}))
    assert node_rejoin.load(str(path)) is None  # torch's handler did not say its round


def test_a_replacement_is_the_same_rank_started_as_a_replacement():
    env = node_rejoin.replacement_env({"RANK": "1", "TORCHELASTIC_ERROR_FILE": "/tmp/gone/error.json",
                                       ENV_AGENT_PID: "77"}, 4242)
    assert env == {"RANK": "1", heal_env.REPLACEMENT: "1", ENV_AGENT_PID: "4242"}


def _worker(tmp_path, code: str) -> dict:
    return {"local_rank": 0, "argv": [sys.executable, "-c", code], "env": {"PATH": "/usr/bin:/bin"},
            "cwd": str(tmp_path)}


def test_replacements_that_succeed_join_the_agents_exit_barrier_in_the_lost_agents_place(tmp_path):
    """The survivors' agent waits in torch's exit barrier (and, on the store's host, for every
    other node's last word): the stand-in takes the lost agent's place in both, or the others
    wait out 300 s and 30 s."""
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))
    prefix = "torch.rendezvous.emu-test.0"
    survivor = dist.PrefixStore(prefix, host)
    done: list[bool] = []
    other = threading.Thread(target=lambda: (
        store_util.barrier(store=survivor, world_size=2, key_prefix=_TERMINAL_STATE_SYNC_ID, barrier_timeout=30),
        done.append(agent.wait_for_clients(survivor, 1, timeout_s=30))))
    other.start()
    record = {"workers": [_worker(tmp_path, "import os; print(os.environ['SLIPSTREAM_HEAL_REPLACEMENT'])")] * 2,
              "store": {"prefix": prefix, "nodes": 2}}
    assert node_rejoin.run(record, f"127.0.0.1:{host.port}") == 0
    other.join(timeout=30)
    assert done == [True]


def test_a_replacement_that_fails_stops_the_others_and_fails_the_node(tmp_path):
    record = {"workers": [_worker(tmp_path, "raise SystemExit(3)"), _worker(tmp_path, "import time; time.sleep(60)")],
              "store": {"prefix": "p", "nodes": 2}}
    assert node_rejoin.run(record, "127.0.0.1:1") == 1
