"""The supervisor of ``slipstream run --heal`` (slipstream.launch.supervisor), on real processes.

The worker entry is started as the elastic agent starts it, with ``SLIPSTREAM_HEAL=1``;
the script stands for the training process and decides how it ends. The spare starts
lazily (SLIPSTREAM_HEAL_SPARE_AFTER_S after the training process armed; 3 s by default).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import os, signal, sys, time
out = sys.argv[1]
mode = sys.argv[2]
n = len([f for f in os.listdir(out) if f.startswith("run")])
open(os.path.join(out, f"run{n}"), "w").write(os.environ.get("SLIPSTREAM_HEAL_REPLACEMENT", "0"))
open(os.path.join(out, f"policy{n}"), "w").write(str(os.sched_getscheduler(0)))
supervisor = os.getppid()

def others():
    """The supervisor's other children (a spare): pid -> scheduling policy."""
    pids = open(f"/proc/{supervisor}/task/{supervisor}/children").read().split()
    found = {}
    for pid in pids:
        if int(pid) != os.getpid():
            try:
                found[pid] = os.sched_getscheduler(int(pid))
            except OSError:
                pass
    return found

def arm():
    open(os.environ["SLIPSTREAM_HEAL_ARMED_FILE"], "w").write("1")
    return time.monotonic()

if mode == "short" :
    arm()
    time.sleep(1.0)
    open(os.path.join(out, "others"), "w").write(" ".join(others()))
    sys.exit(0)
if mode == "lazy" and n == 0:
    armed = arm()
    deadline = time.monotonic() + 60
    while os.SCHED_IDLE not in others().values():
        assert time.monotonic() < deadline, others()
        time.sleep(0.02)
    open(os.path.join(out, "spare_after_s"), "w").write(str(time.monotonic() - armed))
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "raised":
    armed = arm()
    deadline = time.monotonic() + 60
    while os.SCHED_IDLE not in others().values():
        assert time.monotonic() < deadline, others()
        time.sleep(0.02)
    while os.SCHED_OTHER not in others().values():
        assert time.monotonic() < deadline, others()
        time.sleep(0.02)
    open(os.path.join(out, "normal_after_s"), "w").write(str(time.monotonic() - armed))
    sys.exit(0)
if mode == "exit3":
    sys.exit(3)
if mode in ("armed-kill", "unarmed-kill") and n == 0:
    if mode == "armed-kill":
        open(os.environ["SLIPSTREAM_HEAL_ARMED_FILE"], "w").write("1")
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    arm()
    deadline = time.monotonic() + 60
    while not others():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    open(os.path.join(out, "ready"), "w").close()
    time.sleep(60)
'''


def supervise(tmp_path: Path, mode: str, spares: str = "1", wait: bool = True, spare_after_s: str | None = None,
              idle_s: str | None = None):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "SLIPSTREAM_HEAL": "1", "SLIPSTREAM_HEAL_SPARES": spares, "RANK": "0",
           "SLIPSTREAM_HEAL_PID_DIR": str(tmp_path), "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    env.pop("SLIPSTREAM_AGENT_PID", None)
    for name, value in (("SLIPSTREAM_HEAL_SPARE_AFTER_S", spare_after_s), ("SLIPSTREAM_HEAL_SPARE_IDLE_S", idle_s)):
        env.pop(name, None)
        if value is not None:
            env[name] = value
    proc = subprocess.Popen([sys.executable, "-m", "slipstream.launch.worker", str(script), str(out), mode],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc, out
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, out, stderr


def runs(out: Path) -> list[str]:
    return [(out / f"run{i}").read_text() for i in range(len(list(out.glob("run*"))))]


def test_an_exit_code_goes_to_the_agent_unchanged(tmp_path):
    code, out, err = supervise(tmp_path, "exit3")
    assert code == 3 and runs(out) == ["0"]
    assert "replacing" not in err


def test_a_death_before_arming_is_passed_on_as_the_signal(tmp_path):
    code, out, err = supervise(tmp_path, "unarmed-kill")
    assert code == -signal.SIGKILL and runs(out) == ["0"]
    assert "replacing" not in err


def test_an_armed_process_that_dies_before_its_spare_started_is_replaced_cold(tmp_path):
    code, out, err = supervise(tmp_path, "armed-kill")
    assert code == 0, err
    assert runs(out) == ["0", "1"]  # the replacement knows it is one
    assert "replacing it in place with a new process (the spare starts 3 s after the training process arms), " \
           "heal 1" in err


def test_a_short_run_starts_no_spare(tmp_path):
    # Armed for 1 s of a 3 s wait: no spare (its imports: ~276 MB and 1-2 s of CPU per rank).
    code, out, err = supervise(tmp_path, "short")
    assert code == 0, err
    assert (out / "others").read_text() == "", "a spare was started"


def test_the_spare_starts_once_armed_a_while_at_idle_priority_and_replaces_warm(tmp_path):
    code, out, err = supervise(tmp_path, "lazy", spare_after_s="1.5")
    assert code == 0, err
    assert runs(out) == ["0", "1"]
    assert float((out / "spare_after_s").read_text()) >= 1.5  # not before the wait (seen at SCHED_IDLE meanwhile)
    assert "replacing it in place with a warm spare, heal 1" in err
    # The spare became the training process: its normal priority back.
    assert [(out / f"policy{i}").read_text() for i in (0, 1)] == [str(os.SCHED_OTHER)] * 2


def test_without_spares_the_replacement_starts_cold(tmp_path):
    code, out, err = supervise(tmp_path, "armed-kill", spares="0")
    assert code == 0, err
    assert runs(out) == ["0", "1"]
    assert "a new process (no spare left)" in err


def test_a_spare_idle_too_long_gets_a_normal_share_of_the_cpu(tmp_path):
    # Under SCHED_IDLE a spare beside a training that keeps every core busy would never be ready.
    code, out, err = supervise(tmp_path, "raised", spare_after_s="0", idle_s="1")
    assert code == 0, err
    assert 1.0 <= float((out / "normal_after_s").read_text()) < 30  # idle (seen) for at most 1 s once started


def test_sigterm_reaches_the_training_process_and_no_spare_stays(tmp_path):
    proc, out = supervise(tmp_path, "term", wait=False, spare_after_s="0")
    deadline = time.monotonic() + 60
    while not (out / "ready").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    child = int((tmp_path / "rank0.pid").read_text())
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    assert str(child) in children and len(children) == 2  # the training process and a warm spare
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    for pid in children:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
