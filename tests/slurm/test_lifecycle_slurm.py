"""slipstream status|logs|cancel against a real Slurm cluster (scripts/slurm_cluster.sh: two
slurmd nodes on this host, no accounting database, so finished jobs come from scontrol).

Tiny `sbatch --wrap` jobs, no torch. Skipped without Slurm or root; under CI=true they must run.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from slipstream.cli import main as slipstream_main
from slipstream.job.submissions import record_submission


@pytest.fixture(scope="module")
def cluster(slurm_conf):
    """The cluster of tests/slurm/conftest.py (started once per session)."""
    return {**os.environ, "SLURM_CONF": slurm_conf}


@pytest.fixture(autouse=True)
def _commands_see_the_cluster(cluster, monkeypatch, tmp_path):
    """In-process CLI calls: the cluster's slurm.conf, and submission records in this test's directory."""
    monkeypatch.setenv("SLURM_CONF", cluster["SLURM_CONF"])
    monkeypatch.setenv("SLIPSTREAM_STATE_DIR", str(tmp_path / "state"))


def sbatch(env, tmp_path, script: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", "-J", "lc-test", "-o", str(tmp_path / "slurm-%j.out"),
                          "--wrap", script], env=env, capture_output=True, text=True, timeout=30, check=True)
    return out.stdout.strip().split(";")[0]


def state_of(job_id: str, env) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True, timeout=30)
    return next((f.split("=", 1)[1] for f in out.stdout.split() if f.startswith("JobState=")), "")


def wait_state(job_id: str, env, states: set[str], timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        state = state_of(job_id, env)
        if state in states:
            return state
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} still {state!r} after {timeout_s} s, wanted one of {states}")


def run_cli(argv, capsys) -> tuple[int, str, str]:
    rc = slipstream_main(argv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_status_logs_follow_and_cancel(cluster, tmp_path, capsys):
    env = cluster
    # The tagged job runs until the test has seen it running: it waits for a file the test writes
    # (an event, not a fixed `sleep 3` that a loaded machine could outlast before `status` looked),
    # giving up after 120 s so that a failed test leaves no job behind.
    go = tmp_path / "go"
    tagged = sbatch(env, tmp_path, f"echo '[rank0]:start'; echo '[rank1]:other'; "
                                   f"for i in $(seq 1200); do [ -e {go} ] && break; sleep 0.1; done; echo '[rank0]:end'")
    # Both jobs start together: the budget is one scheduler pass, not two.
    victim = sbatch(env, tmp_path, "echo 'about to sleep'; sleep 120")
    run_dir = tmp_path / "run"
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "metrics" / "rank0.jsonl").write_text('{"step": 7, "loss": 3.25, "time_s": 1.0}\n')
    record_submission(name="tagged-job", target="slurm", engine_id=tagged, run_dir=str(run_dir))
    wait_state(tagged, env, {"RUNNING"})

    # A running job: state from squeue, with the node, requeues and the run's progress.
    rc, out, err = run_cli(["status", "tagged-job"], capsys)
    assert rc == 0, err
    assert f"job:      tagged-job, {tagged} (slurm, squeue)" in out
    assert "state:    RUNNING" in out and "nodes:    n" in out and "requeues: 0" in out
    assert "progress: step 7, loss 3.2500" in out

    # -f follows the output file until the job ends; --rank keeps rank 0's lines.
    go.touch()
    t0 = time.monotonic()
    rc, out, err = run_cli(["logs", "tagged-job", "-f", "--rank", "0"], capsys)
    assert rc == 0, err
    assert out.splitlines() == ["[rank0]:start", "[rank0]:end"]
    assert time.monotonic() - t0 < 60  # it stops once the job has ended (a hang would not)

    # Finished: no accounting on this cluster, so scontrol says it (sacct cannot).
    rc, out, err = run_cli(["status", tagged, "--target", "slurm"], capsys)
    assert rc == 0, err
    assert "state:    COMPLETED, exit code 0:0" in out and "scontrol; no accounting on this cluster" in out
    rc, out, _ = run_cli(["logs", tagged, "--target", "slurm"], capsys)
    assert out.splitlines() == ["[rank0]:start", "[rank1]:other", "[rank0]:end"]

    # Cancel a running job and see it CANCELLED.
    wait_state(victim, env, {"RUNNING"})
    rc, out, err = run_cli(["cancel", victim, "--target", "slurm"], capsys)
    assert rc == 0, err
    assert out.strip() == f"cancelled Slurm job {victim}: CANCELLED"
    rc, out, _ = run_cli(["status", victim, "--target", "slurm"], capsys)
    assert "state:    CANCELLED" in out
    rc, out, _ = run_cli(["cancel", victim, "--target", "slurm"], capsys)
    assert rc == 0 and "already finished (CANCELLED)" in out


def test_an_unknown_job_id_is_one_line_and_exit_2(cluster, capsys):
    rc, out, err = run_cli(["status", "999999", "--target", "slurm"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Slurm does not know job 999999" in err
