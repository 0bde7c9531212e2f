"""One live writer per checkpoint directory (slipstream.checkpoint.lease, issue #20)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from slipstream.checkpoint import CheckpointDirInUse, CheckpointManager
from slipstream.checkpoint import lease as lease_mod
from slipstream.checkpoint.lease import LEASE_FILE, Holder, Lease, this_holder
from slipstream.errors import ConfigError
from slipstream.resilience.pids import alive as pid_alive
from slipstream.resilience.pids import start_time

from ..data.conftest import s3, s3_endpoint  # noqa: F401 - the moto S3 server fixtures

HOST = socket.gethostname()
FAST = {"interval_s": 0.05, "stale_after_s": 0.3}
# Where a holder must stay fresh: a loaded machine may starve a 0.05 s heartbeat thread
# past 0.3 s, and a record written a moment ago would count as stale.
FRESH = {"interval_s": 0.05, "stale_after_s": 60.0}
DEADLINE_S = 30.0  # how long a test waits for something that takes milliseconds when all is well


def _until(condition, what: str) -> None:
    """Wait for ``condition()`` (polled), failing after DEADLINE_S: no fixed window to miss."""
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not seen within {DEADLINE_S:g} s")
        time.sleep(0.02)


@pytest.fixture
def sleeper():
    """A live process on this host that is not us (a holder that is still running)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _record(directory, **fields) -> None:
    base = {"run_id": "job-other", "host": HOST, "pid": 1, "attempt": 0, "pid_start": None, "heartbeat_unix_s": time.time()}
    with open(os.path.join(directory, LEASE_FILE), "w") as f:
        json.dump({**base, **fields}, f)


def _on_disk(directory) -> dict:
    with open(os.path.join(directory, LEASE_FILE)) as f:
        return json.load(f)


def test_a_second_live_holder_is_refused_in_one_line(tmp_path, sleeper):
    first = Lease(str(tmp_path), holder=Holder("job-a", HOST, sleeper.pid, pid_start=start_time(sleeper.pid)), **FRESH)
    first.acquire()
    try:
        with pytest.raises(CheckpointDirInUse) as info:
            Lease(str(tmp_path), **FRESH).acquire()
        message = str(info.value)
        assert "\n" not in message
        assert f"run job-a (host {HOST}, pid {sleeper.pid}, attempt 0, last heartbeat" in message, message
        assert "s ago)" in message and LEASE_FILE in message, message
        assert info.value.exit_code == 2
        assert _on_disk(tmp_path)["run_id"] == "job-a"
    finally:
        first.release()
    assert not os.path.exists(tmp_path / LEASE_FILE)


def test_a_dead_holder_on_this_host_is_taken_over_at_once(tmp_path, caplog):
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: its pid names no process now
    assert not pid_alive(proc.pid)
    _record(tmp_path, run_id="job-dead", pid=proc.pid)  # heartbeat fresh: only the pid says it is gone
    lease = Lease(str(tmp_path), **FAST)
    with caplog.at_level(logging.WARNING, logger="slipstream.checkpoint"):
        lease.acquire()
    try:
        assert _on_disk(tmp_path)["run_id"] == lease.holder.run_id
        taken = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
        assert len(taken) == 1 and "run job-dead" in taken[0] and "process is gone" in taken[0], taken
    finally:
        lease.release()


def test_a_reused_pid_does_not_keep_a_dead_holder_alive(sleeper):
    assert pid_alive(sleeper.pid, start_time(sleeper.pid))
    assert not pid_alive(sleeper.pid, "1")  # same pid, another start time: another process


def test_another_hosts_holder_is_refused_while_fresh_and_taken_over_when_stale(tmp_path, caplog):
    _record(tmp_path, run_id="job-far", host="node-elsewhere", pid=os.getpid())
    with pytest.raises(CheckpointDirInUse, match=r"run job-far \(host node-elsewhere"):
        Lease(str(tmp_path), **FRESH).acquire()
    _record(tmp_path, run_id="job-far", host="node-elsewhere", pid=os.getpid(), heartbeat_unix_s=time.time() - 1.0)
    lease = Lease(str(tmp_path), **FAST)
    with caplog.at_level(logging.WARNING, logger="slipstream.checkpoint"):
        lease.acquire()
    try:
        taken = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
        assert len(taken) == 1 and "run job-far" in taken[0] and "no heartbeat for" in taken[0], taken
        assert _on_disk(tmp_path)["run_id"] == lease.holder.run_id
    finally:
        lease.release()


def test_a_restart_of_the_same_run_keeps_its_lease(tmp_path, sleeper):
    _record(tmp_path, run_id="job-7", host="node-elsewhere", pid=sleeper.pid, attempt=0)
    lease = Lease(str(tmp_path), holder=Holder("job-7", HOST, os.getpid(), attempt=1), **FAST)
    lease.acquire()
    try:
        record = _on_disk(tmp_path)
        assert (record["run_id"], record["attempt"], record["pid"]) == ("job-7", 1, os.getpid())
    finally:
        lease.release()


def test_identity_from_the_elastic_environment(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_AGENT_PID", raising=False)
    mine = this_holder({})
    assert mine.pid == os.getpid() and mine.host == HOST and mine.run_id.startswith(f"{HOST}-{os.getpid()}-")
    agent = this_holder({"TORCHELASTIC_RUN_ID": "job-7", "TORCHELASTIC_RESTART_COUNT": "2"})
    assert (agent.run_id, agent.pid, agent.attempt) == ("job-7", os.getppid(), 2)
    # torchrun's default id is shared by unrelated jobs: not a run id; the agent's pid and host are.
    for shared in ("none", ""):
        default = this_holder({"TORCHELASTIC_RUN_ID": shared})
        assert default.run_id.startswith(f"{HOST}-{os.getppid()}-"), default
    assert this_holder({"TORCHELASTIC_RUN_ID": "none", "SLIPSTREAM_AGENT_PID": "4242"}).pid == 4242


def test_the_record_is_written_atomically(tmp_path, monkeypatch):
    lease = Lease(str(tmp_path), **FAST)
    lease.acquire()
    first = _on_disk(tmp_path)["heartbeat_unix_s"]
    _until(lambda: _on_disk(tmp_path)["heartbeat_unix_s"] > first, "a heartbeat after the first record")
    lease.release()
    assert os.listdir(tmp_path) == []

    def crash(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lease_mod.os, "fsync", crash)  # the write dies before its rename
    with pytest.raises(OSError):
        Lease(str(tmp_path), **FAST).acquire()
    assert os.listdir(tmp_path) == []  # neither a partial record nor a temporary file


def test_the_heartbeat_notices_a_takeover_and_release_leaves_the_new_holder(tmp_path, caplog):
    lease = Lease(str(tmp_path), **FAST)
    lease.acquire()
    with caplog.at_level(logging.ERROR, logger="slipstream.checkpoint"):
        _record(tmp_path, run_id="job-thief", host="node-elsewhere")
        _until(lambda: lease.lost, "the heartbeat noticing the takeover")
    lease.release()
    assert lease.lost and any("taken over by run job-thief" in r.getMessage() for r in caplog.records)
    assert _on_disk(tmp_path)["run_id"] == "job-thief"


def test_an_unreadable_record_is_replaced_and_a_deleted_directory_stops_the_heartbeat(tmp_path, caplog):
    (tmp_path / LEASE_FILE).write_text("{not json")
    lease = Lease(str(tmp_path), **FAST)
    with caplog.at_level(logging.WARNING, logger="slipstream.checkpoint"):
        lease.acquire()
        assert _on_disk(tmp_path)["run_id"] == lease.holder.run_id
        os.unlink(tmp_path / LEASE_FILE)
        os.rmdir(tmp_path)  # a test's tmp_path removed under a manager never closed
        lease._thread.join(timeout=DEADLINE_S)
    assert not lease._thread.is_alive()
    assert any("is gone; its lease heartbeat stops" in r.getMessage() for r in caplog.records)
    lease.release()


def test_an_object_store_directory(s3):  # noqa: F811 - the fixture imported above
    url, opts, client = s3
    directory = f"{url}/ckpt"
    lease = Lease(directory, storage_options=opts, interval_s=5.0)
    lease.acquire()
    try:
        bucket = url[len("s3://"):]
        record = json.loads(client.get_object(Bucket=bucket, Key=f"ckpt/{LEASE_FILE}")["Body"].read())
        assert record["run_id"] == lease.holder.run_id
        other = Holder("job-b", "node-elsewhere", 1)
        with pytest.raises(CheckpointDirInUse, match=rf"in use by run {lease.holder.run_id} \(host {HOST}"):
            Lease(directory, storage_options=opts, interval_s=5.0, holder=other).acquire()
    finally:
        lease.release()
    assert client.list_objects_v2(Bucket=bucket, Prefix="ckpt/").get("KeyCount", 0) == 0


def test_a_url_without_fsspec_is_one_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec raises ImportError
    with pytest.raises(ConfigError, match=r"s3://bucket/ckpt is a URL, which needs fsspec: pip install 'slipstream\[data\]'"):
        Lease("s3://bucket/ckpt")


def test_the_manager_takes_the_lease_and_close_releases_it(tmp_path, sleeper):
    manager = CheckpointManager(str(tmp_path), handle_sigterm=False, lease_interval_s=0.05)
    assert _on_disk(tmp_path)["run_id"] == this_holder().run_id
    same_process = CheckpointManager(str(tmp_path), handle_sigterm=False)  # same run: allowed (a reader, a test)
    same_process.close()
    manager.close()
    assert not os.path.exists(tmp_path / LEASE_FILE)
    _record(tmp_path, run_id="job-live", pid=sleeper.pid)
    with pytest.raises(CheckpointDirInUse, match=rf"in use by run job-live \(host {HOST}, pid {sleeper.pid}"):
        CheckpointManager(str(tmp_path), handle_sigterm=False)


HOLDER = textwrap.dedent("""
    import os, sys, time
    from slipstream.checkpoint import CheckpointManager
    while len(sys.argv) > 2 and not os.path.exists(os.path.join(sys.argv[1], ".lease.json")):
        time.sleep(0.02)  # the second job: imported alongside the first, it starts once the first holds
    # Beats every 5 s (stale after 30 s): the second job, importing torch on a loaded
    # machine, must find this holder fresh, however late the heartbeat thread runs.
    manager = CheckpointManager(sys.argv[1], handle_sigterm=False, lease_interval_s=5.0)
    print("holding", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    manager.close()
""")


def test_a_second_job_on_the_same_directory_exits_2_with_one_line(tmp_path):
    directory = str(tmp_path / "ckpt")
    script = tmp_path / "train.py"
    script.write_text(HOLDER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "SLIPSTREAM_AGENT"))}
    first = subprocess.Popen([sys.executable, str(script), directory], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    # Started together, so the two imports of torch overlap (the suite is near its time budget).
    second = subprocess.Popen(
        [sys.executable, "-m", "slipstream.launch.worker", str(script), directory, "--second"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert first.stdout.readline().strip() == "holding"
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, err
        assert f"checkpoint_dir {directory} is in use by run {HOST}-{first.pid}-" in lines[0], lines[0]
        assert f"(host {HOST}, pid {first.pid}, attempt 0, last heartbeat" in lines[0], lines[0]
    finally:
        second.kill()
        first.stdin.close()
        assert first.wait(timeout=30) == 0
    assert not os.path.exists(os.path.join(directory, LEASE_FILE))  # the first job released it


def test_a_job_whose_lease_was_taken_over_writes_no_more_checkpoints(tmp_path):
    from slipstream.checkpoint.states import RNGState

    manager = CheckpointManager(str(tmp_path), handle_sigterm=False, lease_interval_s=0.05)
    manager.register("rng", RNGState(), per_rank=True)
    assert manager.save(1)
    _record(tmp_path, run_id="job-thief", host="node-elsewhere")  # another job took the directory over
    _until(lambda: manager.lease.lost, "the heartbeat noticing the takeover")
    with pytest.raises(CheckpointDirInUse, match="another job took over its writer lease"):
        manager.save(2)
    manager.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [LEASE_FILE, "step_00000001"]
    assert _on_disk(tmp_path)["run_id"] == "job-thief"  # close() left the new holder's record alone
