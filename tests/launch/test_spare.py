"""The warm spare (slipstream.launch.spare) on a real process: what it leaves running under the script."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys

import torch.distributed as dist

from slipstream.resilience import heal_env


def test_the_eviction_watcher_has_ended_before_the_script_runs(tmp_path):
    """The spare's watcher thread (a heal-store client) is joined before the script starts: a thread
    left in a store call when a short script ends can abort the process in interpreter teardown
    (a trivial two-rank launch under default healing ended with a worker's SIGABRT)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    out = tmp_path / "threads"
    script = tmp_path / "train.py"
    script.write_text(f"import threading\nopen({str(out)!r}, 'w').write(' '.join(t.name for t in threading.enumerate()))\n")
    env = {**os.environ, heal_env.STORE: f"127.0.0.1:{store.port}", "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0",
           "OMP_NUM_THREADS": "1"}
    for name in (heal_env.HEAL, heal_env.CHILD, "SLIPSTREAM_AGENT_PID"):
        env.pop(name, None)
    order = json.dumps({"argv": [str(script)], "replacement": False}) + "\n"
    proc = subprocess.run([sys.executable, "-m", "slipstream.launch.spare"], input=order, text=True,
                          capture_output=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "MainThread" in out.read_text()
    assert "slipstream-evict-watch" not in out.read_text()


def test_the_first_training_process_imports_only_what_its_script_does(tmp_path):
    """Under the supervisor (healing on, the default at more than one rank), the rank's first training
    process is a spare told to run at once: no warm imports ahead of a script that does not need them
    (torch._dynamo alone costs seconds of CPU per rank, paid before every run's first step)."""
    out = tmp_path / "modules"
    script = tmp_path / "train.py"
    script.write_text(f"import sys\nopen({str(out)!r}, 'w').write(' '.join(sorted(sys.modules)))\n")
    env = {**os.environ, heal_env.HEAL: "1", "RANK": "0", "OMP_NUM_THREADS": "1"}
    for name in (heal_env.CHILD, heal_env.STORE, "SLIPSTREAM_AGENT_PID"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "slipstream.launch.worker", str(script)], text=True,
                          capture_output=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    modules = out.read_text().split()
    assert "runpy" in modules  # the script ran, through the worker entry
    assert "torch._dynamo" not in modules and "torch.distributed.checkpoint" not in modules
