"""runtime.started(): the public accessor of the runtime init() started (None before and after)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import datetime
from slipstream.process import runtime
assert runtime.started() is None
assert runtime.group_timeout() == datetime.timedelta(seconds=42)   # from the environment
rt = runtime.init(backend="gloo", device="cpu", timeout_s=7)
assert runtime.started() is rt and runtime.current() is rt
assert (rt.launcher if hasattr(rt, "launcher") else rt.launch.launcher) == "single"
assert runtime.group_timeout() == datetime.timedelta(seconds=7)    # the running one's
runtime.shutdown()
assert runtime.started() is None
print("ok", end="")
"""


def test_started_is_none_until_init_and_after_shutdown():
    env = {**_clean_env(), "SLIPSTREAM_COLLECTIVE_TIMEOUT_S": "42"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env,
                       check=False)
    assert r.returncode == 0 and r.stdout == "ok", r.stderr


def _clean_env() -> dict[str, str]:
    import os

    launch = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_", "OMPI_", "PMI_", "MPI_")
    return {k: v for k, v in os.environ.items() if not k.startswith(launch)}
