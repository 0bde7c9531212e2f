"""Fault injection under gloo, each against an uninterrupted reference run.

Equality claims (2 ranks, same world size): final parameters and optimizer
state bitwise equal; the samples consumed at every step equal; redone work at
most one checkpoint interval. Across world sizes (resharding): the state loaded
equals the state saved exactly, and training continues on the same global
samples, so parameters match the uninterrupted run to floating-point tolerance
(the all-reduce adds in a different order).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slipstream.launch.proc import kill_tree

HERE = Path(__file__).parent
REPO = HERE.parent.parent
SCRIPT = str(HERE / "scripts_ft_train.py")
EVERY = 2
STEPS = 12
RESTART = "--no-heal"
"""The full restart these tests check: healing in place is on by default at 2 ranks and would heal
these failures instead (tests/integration/test_heal_in_place.py checks that path)."""


def launch(*args: str, env: dict | None = None, timeout: float = 240, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "slipstream", "run", *args], capture_output=True, text=True, timeout=timeout,
        cwd=REPO, env={**os.environ, "SLIPSTREAM_PREEMPTION_DEADLINE_S": "3", **(env or {})}, **kw,
    )


class Background:
    """A `slipstream run` started now and waited for later: an uninterrupted reference run
    goes alongside the run it is compared with (most of either is starting processes)."""

    def __init__(self, *args: str, log: Path) -> None:
        self.log = log
        with open(log, "w") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "slipstream", "run", *args], cwd=REPO, stdout=fh, stderr=subprocess.STDOUT,
                env={**os.environ, "SLIPSTREAM_PREEMPTION_DEADLINE_S": "3"}, start_new_session=True,
            )

    def wait(self, timeout: float = 240) -> None:
        """Wait for a clean exit; its output in the assertion otherwise."""
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        assert code == 0, self.log.read_text()[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc.pid)
            self.proc.wait()


def final(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=False)


def assert_state_equal(a: dict, b: dict, exact: bool = True) -> None:
    for k in a["model"]:
        if exact:
            assert torch.equal(a["model"][k], b["model"][k]), f"parameter {k} differs"
        else:
            torch.testing.assert_close(a["model"][k], b["model"][k], rtol=1e-4, atol=1e-6, msg=k)
    for pid, sa in a["optimizer"]["state"].items():
        for name, ta in sa.items():
            tb = b["optimizer"]["state"][pid][name]
            if exact:
                assert torch.equal(torch.as_tensor(ta), torch.as_tensor(tb)), f"optimizer state {pid}/{name} differs"
            else:
                torch.testing.assert_close(torch.as_tensor(ta), torch.as_tensor(tb), rtol=1e-4, atol=1e-6)


def consumed(out: Path, ranks: int) -> tuple[dict, int]:
    """{(rank, step): (world_size, first_id, last_id)} keeping the last time each step ran; and how many steps ran twice."""
    last, redone = {}, 0
    for r in range(ranks):
        path = out / f"ids_rank{r}.log"
        if not path.exists():
            continue
        for line in path.read_text().split("\n"):
            if line:
                step, world, first, end = map(int, line.split())
                if (r, step) in last:
                    redone += 1
                last[(r, step)] = (world, first, end)
    return last, redone


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    proc = launch("-n", "2", SCRIPT, "--out", str(out), "--steps", str(STEPS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def check_against_reference(out: Path, reference: Path) -> int:
    assert_state_equal(final(reference), final(out), exact=True)
    ours, redone = consumed(out, 2)
    theirs, _ = consumed(reference, 2)
    assert ours == theirs
    return redone


@pytest.mark.parametrize("mode,async_save", [("sigkill", False), ("exception", False), ("sigkill", True)])
def test_failure_resumes_with_bitwise_equal_result(mode, async_save, reference, tmp_path):
    extra = ["--async-save"] if async_save else []
    proc = launch("-n", "2", "--max-restarts", "1", RESTART, SCRIPT, "--out", str(tmp_path), "--ckpt",
                  str(tmp_path / "ckpt"), "--every", str(EVERY), "--steps", str(STEPS), "--mode", mode, "--fail-step",
                  "5", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    redone = check_against_reference(tmp_path, reference)
    # Each of the 2 ranks redoes at most one interval; with asynchronous saves the
    # checkpoint still being written when the failure struck is lost too.
    assert redone <= 2 * EVERY * (2 if async_save else 1)
    assert "rank 1 failed first" in proc.stderr or mode == "exception"


def test_a_killed_worker_resumes_from_its_in_memory_snapshot(reference, tmp_path):
    """--snapshot-every-steps 1 and no disk checkpoint before the end: the restart loads step 5
    from host memory (not from scratch), redoes no step, and ends bitwise equal, sample for sample."""
    snapshots = tmp_path / "shm"
    proc = launch("-n", "2", "--max-restarts", "1", RESTART, "--snapshot-every-steps", "1", SCRIPT, "--out", str(tmp_path),
                  "--ckpt", str(tmp_path / "ckpt"), "--every", "100", "--steps", str(STEPS), "--mode", "sigkill",
                  "--fail-step", "5", env={"SLIPSTREAM_SNAPSHOT_DIR": str(snapshots)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from an in-memory snapshot (newest checkpoint in" in proc.stdout and "none) at step 5" in proc.stdout, \
        proc.stdout[-3000:]
    redone = check_against_reference(tmp_path, reference)
    assert redone <= 2, redone  # at most the step each rank was in when rank 1 died
    resumed = torch.load(tmp_path / "resumed_1.pt", weights_only=False)
    assert resumed["step"] == 5
    # the launcher deleted its workers' snapshots when it exited
    assert not any(p.is_file() for p in snapshots.rglob("*")), sorted(snapshots.rglob("*"))


def test_compressed_sync_state_is_restored_bitwise(tmp_path):
    """PowerSGD's error-feedback buffers and low-rank factors are per-rank checkpoint state."""
    common = ["--sync", "powersgd", "--sync-options", '{"rank": 2, "min_compression": 1.0}', "-n", "2"]
    ref = tmp_path / "ref"
    reference = Background(*common, SCRIPT, "--out", str(ref), "--steps", "8", "--dropout", "0", log=tmp_path / "ref.log")
    try:
        out = tmp_path / "killed"
        # RESTART: under the default a run that cannot heal still snapshots every step (accelerate()), and the
        # restart would resume from that snapshot, not from the disk checkpoint this test checks.
        proc = launch(*common, "--max-restarts", "1", RESTART, SCRIPT, "--out", str(out), "--ckpt",
                      str(tmp_path / "ckpt"),
                      "--every", "2", "--steps", "8", "--dropout", "0", "--mode", "sigkill", "--fail-step", "5")
        reference.wait()
    finally:
        reference.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / "step_00000004" / "rank1.pt").exists()
    assert_state_equal(final(ref), final(out), exact=True)


def test_checkpoint_killed_mid_write_is_never_loaded(reference, tmp_path):
    proc = launch("-n", "2", "--max-restarts", "1", RESTART, SCRIPT, "--out", str(tmp_path), "--ckpt",
                  str(tmp_path / "ckpt"), "--every", str(EVERY), "--steps", str(STEPS), "--mode", "kill-in-save",
                  "--fail-step", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The checkpoint of step 6 was being written when rank 1 died: the restart used step 4's.
    resumed = torch.load(tmp_path / "resumed_1.pt", weights_only=False)
    assert resumed["step"] == 4
    check_against_reference(tmp_path, reference)
    assert not list((tmp_path / "ckpt").glob("*.partial"))  # the debris was cleaned up


def test_hang_is_detected_diagnosed_and_recovered(reference, tmp_path):
    timeout_s = 6.0
    run_dir = tmp_path / "run"
    proc = launch("-n", "2", "--max-restarts", "1", RESTART, "--collective-timeout-s", str(timeout_s), "--run-dir",
                  str(run_dir), SCRIPT, "--out", str(tmp_path), "--ckpt", str(tmp_path / "ckpt"), "--every",
                  str(EVERY), "--steps", str(STEPS), "--mode", "hang", "--fail-step", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = float((tmp_path / "hang_started").read_text())
    detected = (run_dir / "hang.txt").stat().st_mtime
    assert detected - started <= 1.5 * timeout_s, f"hang reported {detected - started:.1f} s after it began"
    report = (run_dir / "hang.txt").read_text()
    assert "rank 1 stalled first" in report and "user code between steps after step 5" in report
    assert "backward (gradient all-reduce) of step 6" in report
    check_against_reference(tmp_path, reference)


def test_sigterm_writes_an_emergency_checkpoint_and_a_relaunch_finishes(reference, tmp_path):
    ckpt = tmp_path / "ckpt"
    args = [sys.executable, "-m", "slipstream", "run", "-n", "2", SCRIPT, "--out", str(tmp_path), "--ckpt", str(ckpt),
            "--every", "100", "--steps", str(STEPS), "--step-sleep-s", "0.3"]
    env = {**os.environ, "SLIPSTREAM_PREEMPTION_DEADLINE_S": "10"}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = tmp_path / "ids_rank0.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what the kubelet does on eviction
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    saved = sorted(p.name for p in ckpt.iterdir() if p.name != ".lease.json")  # the lease: taken over by the relaunch
    assert len(saved) == 1 and 3 <= int(saved[0].split("_")[1]) < STEPS, saved  # emergency, not scheduled
    assert "preempted (SIGTERM)" in out
    again = launch("-n", "2", SCRIPT, "--out", str(tmp_path), "--ckpt", str(ckpt), "--every", "100", "--steps", str(STEPS))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpt} at step {int(saved[0].split('_')[1])}" in again.stdout
    check_against_reference(tmp_path, reference)


def test_resharding_4_to_2_to_4(tmp_path):
    ckpt = tmp_path / "ckpt"
    common = [SCRIPT, "--ckpt", str(ckpt), "--every", "100", "--dropout", "0"]
    ref = tmp_path / "ref"
    reference = Background("-n", "4", SCRIPT, "--dropout", "0", "--out", str(ref), "--steps", "12", log=tmp_path / "ref.log")
    try:
        for world, steps, name in ((4, 4, "a"), (2, 8, "b"), (4, 12, "c")):
            proc = launch("-n", str(world), *common, "--out", str(tmp_path / name), "--steps", str(steps))
            assert proc.returncode == 0, proc.stderr[-3000:]
        reference.wait()
    finally:
        reference.stop()
    # What a run at another world size loads is exactly what was saved.
    assert_state_equal(final(tmp_path / "a"), torch.load(tmp_path / "b" / "resumed_0.pt", weights_only=False))
    assert_state_equal(final(tmp_path / "b"), torch.load(tmp_path / "c" / "resumed_0.pt", weights_only=False))
    # Same global samples at every step, re-split over the ranks of the moment.
    def global_ids(out: Path, ranks: int) -> dict[int, set]:
        ids: dict[int, set] = {}
        for (r, step), (world, first, end) in consumed(out, ranks)[0].items():
            ids.setdefault(step, set()).update(range(first, end + 1))
        return ids

    pieces = {**global_ids(tmp_path / "a", 4), **global_ids(tmp_path / "b", 2), **global_ids(tmp_path / "c", 4)}
    assert pieces == global_ids(ref, 4)
    assert_state_equal(final(ref), final(tmp_path / "c"), exact=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_elastic_node_loss_and_rejoin(tmp_path):
    """Two agents (--nnodes 1:2); one is killed, the job goes on at one node from the
    last checkpoint; a new agent joins and the job scales back to two."""
    port = _free_port()
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    # 44 steps of >= 0.25 s (0.3 s here): the kill lands at step ~6, the job resumes at one node
    # from step 4 or 8, and node c's start until node a stops for the new rendezvous took 2.4 to
    # 3.75 s (8 to 13 one-node steps) on the 2-core machine under load, against ~36 steps (~11 s)
    # left: ~3x margin. Steps after the rejoin only cost time (it was 80 steps: ~20 s more).
    cmd = [sys.executable, "-m", "slipstream", "run", "-n", "1", "--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", "elastic-test", "--max-restarts", "3",
           "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=2,keep_alive_max_attempt=5",
           SCRIPT, "--out", str(out), "--ckpt", str(ckpt), "--every", "4", "--steps", "44", "--dropout", "0",
           "--step-sleep-s", "0.25"]
    env = {**os.environ, "SLIPSTREAM_PREEMPTION_DEADLINE_S": "3"}

    def start(name: str) -> subprocess.Popen:
        # Node a hosts the rendezvous store (--node-rank 0); the others only join it.
        node_rank = ["--node-rank", "0" if name == "a" else "1"]
        return subprocess.Popen(cmd[:4] + node_rank + cmd[4:], cwd=REPO, env=env, stdout=open(tmp_path / f"{name}.out", "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def worlds() -> list[int]:
        """World size of every step rank 0 ran, in the order it ran them (rank 0 exists at every size)."""
        path = out / "ids_rank0.log"
        lines = path.read_text().splitlines() if path.exists() else []
        return [int(line.split()[1]) for line in lines if line.count(" ") == 3]

    def wait_for(predicate, what: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; worlds so far {worlds()}; "
                             f"log: {(tmp_path / 'a.out').read_text()[-2000:]}")

    def store_listening() -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    a = start("a")
    wait_for(store_listening, "node a's rendezvous store", timeout_s=60)  # a hosts it; b joins it
    b = start("b")
    c = None
    try:
        wait_for(lambda: worlds().count(2) >= 6, "both nodes training")
        kill_tree(b.pid)  # the node is gone: agent and workers together
        b.wait()
        wait_for(lambda: 1 in worlds(), "the job continuing on one node")
        c = start("c")
        wait_for(lambda: worlds()[-1:] == [2] and 1 in worlds(), "the new node joining")
        assert a.wait(timeout=180) == 0, (tmp_path / "a.out").read_text()[-3000:]
        assert c.wait(timeout=60) == 0, (tmp_path / "c.out").read_text()[-3000:]
    finally:
        for p in (a, b, c):
            if p is not None and p.poll() is None:
                kill_tree(p.pid)
    sequence = worlds()
    changes = [w for i, w in enumerate(sequence) if i == 0 or sequence[i - 1] != w]
    assert changes[:3] == [2, 1, 2], sequence
    assert final(out)["model"]  # finished and saved
