"""How the acceptance run starts its subprocesses, stops them, and reads what they leave. No
torch (see plan.py): the orchestrator imports this."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def stop_tree(proc: subprocess.Popen) -> None:
    """Stop a timed-out step and everything it started.

    The elastic agent starts each worker in a session of its own, so the step's
    process group does not reach them: the tree is read first (while it is whole),
    the step gets SIGTERM (`slipstream run` then stops its workers), and whatever
    of the tree is left after a grace period is killed.
    """
    try:
        from slipstream.launch.proc import descendants  # imports torch; only ever needed here

        tree = descendants(proc.pid)
    except Exception:  # noqa: BLE001 - without the tree, the process group is still reached below
        tree = [proc.pid]
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def clean_environ() -> dict[str, str]:
    """This process's environment without SLIPSTREAM_* variables (a strategy or
    precision left set in the shell must not change what a step tests), and with
    the source tree first on PYTHONPATH: every subprocess of the kit (step programs,
    `slipstream run` and its workers) imports this checkout's slipstream and
    benchmarks, installed or not (docs/gpu.md: the bare GPU machine); and with Python's
    faulthandler on (PYTHONFAULTHANDLER=1, inherited by `slipstream run`'s workers and the
    examples' forked runs): a segfault in native code then leaves the Python stack that led
    to it. The first GPU run's FSDP steps died of SIGSEGV with no stack at all; the second,
    rerun with it by hand, showed the crash inside the full-state-dict gather."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM_")}
    env["PYTHONFAULTHANDLER"] = "1"
    for key in ("SLIPSTREAM_BARE_ALLOWED", "SLIPSTREAM_BARE_SRC", "SLIPSTREAM_BARE_AUDIT"):  # the tests' bare machine
        if key in os.environ:
            env[key] = os.environ[key]
    env["PYTHONPATH"] = source_path(os.environ.get("PYTHONPATH", ""))
    return env


def source_path(existing: str) -> str:
    """PYTHONPATH with ROOT/src and ROOT first (once), then what was there."""
    first = [str(ROOT / "src"), str(ROOT)]
    rest = [p for p in existing.split(os.pathsep) if p and os.path.realpath(p) not in map(os.path.realpath, first)]
    return os.pathsep.join(first + rest)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def command_text(cmd: list[str], env: dict[str, str]) -> str:
    shown = [f"{k}={v}" for k, v in sorted(env.items())]
    return " ".join(shown + [shlex.quote(c) for c in ["python" if c == sys.executable else c for c in cmd]])
