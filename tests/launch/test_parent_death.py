"""Workers die with their launcher (slipstream.launch.parent_death): SIGKILL the launcher, no worker trains on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slipstream.launch.proc import descendants, kill_tree
from tests.conftest import cannot_run_here

if not sys.platform.startswith("linux"):
    cannot_run_here("prctl(PR_SET_PDEATHSIG) is Linux-only")

HERE = Path(__file__).parent
ENTRY = [sys.executable, "-m", "slipstream.launch.worker"]


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan reaped late by init is gone for our purpose)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_sigkilled_launcher_takes_its_workers_with_it(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "slipstream", "run", "-n", "2", "--max-restarts", "0",
         str(HERE / "scripts_orphan_worker.py"), str(out)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while len(list(out.glob("pid.?"))) < 2:
            assert launcher.poll() is None, launcher.stderr.read().decode()
            assert time.monotonic() < deadline, "the workers never wrote their pids"
            time.sleep(0.1)
        workers = [int(p.read_text()) for p in sorted(out.glob("pid.?"))]
        assert all(w in descendants(launcher.pid) for w in workers)

        os.kill(launcher.pid, signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait(timeout=10)
        while any(_running(w) for w in workers) and time.monotonic() - killed < 2.0:
            time.sleep(0.01)
        left = [w for w in workers if _running(w)]
        assert not left, f"workers {left} outlived their launcher by 2 s"
        # The figure docs/fault-tolerance.md quotes (pytest -rP shows it).
        print(f"launcher SIGKILL -> last worker gone: {(time.monotonic() - killed) * 1000:.0f} ms")
    finally:
        if launcher.poll() is None:
            kill_tree(launcher.pid)
            launcher.wait(timeout=10)
        for w in workers:
            if _running(w):
                kill_tree(w)
        if launcher.stderr:
            launcher.stderr.close()


def test_a_worker_whose_launcher_is_gone_exits_at_once_with_one_line(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    gone = _dead_pid()
    proc = subprocess.run([*ENTRY, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SLIPSTREAM_AGENT_PID": str(gone)})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"slipstream worker: the launcher (pid {gone}) is gone; exiting"]
    assert not marker.exists()


@pytest.mark.parametrize("agent", ["parent", "alive-not-parent"])
def test_the_script_runs_while_the_launcher_lives(agent, tmp_path):
    """Our own parent (the launcher) or a live non-parent (a wrapper between agent and worker): the script
    runs and sees the variable (the checkpoint lease names the agent by it). Without the variable the entry
    runs as before: tests/integration/test_worker_entry.py."""
    marker = tmp_path / "env"
    script = tmp_path / "train.py"
    script.write_text(f"import os\nopen({str(marker)!r}, 'w').write(os.environ.get('SLIPSTREAM_AGENT_PID', '-'))\n")
    named = str(os.getpid()) if agent == "parent" else "1"
    env = {**os.environ, "SLIPSTREAM_AGENT_PID": named}
    proc = subprocess.run([*ENTRY, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert marker.read_text() == named


def test_die_with_agent_arms_the_death_signal_only_under_its_parent():
    from slipstream.launch.parent_death import die_with_agent

    # In a child, so this test process keeps no death signal: the child reports what prctl(PR_GET_PDEATHSIG) says.
    code = (
        "import ctypes, os, sys\n"
        "from slipstream.launch.parent_death import die_with_agent\n"
        "env = {'SLIPSTREAM_AGENT_PID': str(os.getppid())}\n"
        "armed = die_with_agent(env)\n"
        "sig = ctypes.c_int()\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)\n"  # PR_GET_PDEATHSIG
        "sys.stdout.write(f'{armed} {sig.value}')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out == f"True {int(signal.SIGKILL)}"
    assert die_with_agent({}) is False  # nothing named: nothing done
