"""The suite's records plugin (tests/records.py): what a failed run leaves for its reader."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

INNER = '''
import subprocess, sys
import pytest

@pytest.fixture(scope="module")
def server():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(61)"])
    yield p
    p.kill()
    p.wait()

def test_uses_a_module_server(server):
    assert server.poll() is None

def test_a_worker_logs_then_the_test_fails(tmp_path):
    log = tmp_path / "rank0.log"
    subprocess.run([sys.executable, "-c", "print('rank 0: loss 2.5 at step 7')"],
                   stdout=open(log, "w"), check=True)
    assert 1 + 1 == 3, "the step count disagrees"

def test_leaves_a_process_running(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp_path / "pid").write_text(str(p.pid))

def test_passes():
    pass
'''


def test_a_failed_run_keeps_its_report_its_workers_logs_and_its_leftovers(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    records = tmp_path / "records"
    env = {**os.environ, "SLIPSTREAM_TEST_RECORDS": str(records), "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.records", "-p", "no:cacheprovider",
                          str(tmp_path / "test_inner.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    try:
        assert run.returncode == 1, run.stdout + run.stderr
        # Two tests left a process: the module fixture's server (stopped at the module's end) and a leak.
        assert (f"test records: {records} (1 failure file(s); 2 test(s) left processes running (leftovers.txt); "
                "1 still running at the end (still-running.txt))") in run.stdout, run.stdout
        still = (records / "still-running.txt").read_text()
        assert "time.sleep(60)" in still and "time.sleep(61)" not in still, still
        (failure,) = sorted((records / "failures").glob("*.txt"))
        text = failure.read_text()
        assert "assertion:" in text and "the step count disagrees" in text, text
        assert "rank 0: loss 2.5 at step 7" in text, text  # the worker's log, from the test's tmp_path
        leftovers = (records / "leftovers.txt").read_text()
        assert "test_leaves_a_process_running" in leftovers and "time.sleep(60)" in leftovers, leftovers
        timeline = [json.loads(line) for line in (records / "timeline.jsonl").read_text().splitlines()]
        assert [t["outcome"] for t in timeline] == ["passed", "failed", "passed", "passed"], timeline
        assert [t["leftover_processes"] for t in timeline] == [1, 0, 1, 0], timeline
        # What .ci/run prints at the end of a failed run: the assertion and the worker's last lines.
        show = subprocess.run([sys.executable, "-m", "tests.records", "show", str(records)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert show.returncode == 0, show.stderr
        assert "the step count disagrees" in show.stdout and "rank 0: loss 2.5 at step 7" in show.stdout, show.stdout
    finally:
        for pid_file in tmp_path.rglob("pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass


def test_ci_prints_the_first_failure_at_the_end():
    ci = (REPO / ".ci" / "run").read_text()
    assert "python3 -m tests.records show .test-records/latest" in ci
    assert ci.rstrip().endswith('exit "$rc"'), "the suite's exit code is .ci/run's"
