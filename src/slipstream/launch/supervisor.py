"""The supervisor of one rank under ``slipstream run --heal``: it replaces a dead training process in place.

torch's elastic agent restarts every worker when any one fails. Under ``--heal`` the
worker the agent starts (``python -m slipstream.launch.worker ...``) is this small,
torch-free supervisor, and the training runs in its child. When that child dies by a
signal (SIGKILL, SIGSEGV, the OOM killer) after it armed itself for healing
(:meth:`slipstream.resilience.heal.Healer.arm`), the supervisor starts a replacement for the same
rank and the agent sees nothing fail: the other ranks keep their processes and re-form
the group with it (:mod:`slipstream.resilience.heal`).

The replacement is a *warm spare* (:mod:`slipstream.launch.spare`): a process started
ahead, Python and torch already imported, blocked on a pipe until it is told to run the
script. With ``--spares 0`` a new process is started at the failure instead (it imports
torch then: seconds).

A spare is started lazily: only once the training process armed itself and then trained
``SPARE_AFTER_ARMED_S`` more, and it imports at the lowest CPU priority (``SCHED_IDLE``,
given back when it is activated, or after ``SPARE_IDLE_AT_MOST_S`` on a host with no idle
CPU), so a short run never pays for one (a spare's imports
are about 276 MB and 1-2 s of CPU per rank) and a long one pays while the training does not
need the CPU. A death before the spare is ready is replaced by a new process, as with
``--spares 0``.

Everything else goes to the agent as before, so the full restart stays the fallback:
an exit with a code (a Python exception, a configuration error, a heal that failed, the
preemption's 143), a death before the child armed, a death once the per-rank limit of
heals is used up, or any signal while the job is being stopped. A death by a signal is
passed on as that signal (the supervisor kills itself with it), so the launcher's report
reads as it would without the supervisor.

SIGTERM and SIGINT from the agent go to the training process (preemption: it writes the
emergency checkpoint and exits 143, which the supervisor returns). The supervisor dies
with the agent (:func:`~slipstream.launch.parent_death.die_with_agent`) and its children
with it (the same, with the supervisor as their parent).

Example::

    python -m slipstream.launch.worker train.py --steps 100   # under SLIPSTREAM_HEAL=1: supervises
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

from ..log import CONSOLE
from ..resilience import heal_env
from ..resilience.snapshot_dirs import ENV_OWNER
from .parent_death import ENV_AGENT_PID, die_with_agent
from .proc import set_policy

log = logging.getLogger("slipstream.launch")

DEFAULT_HEAL_LIMIT = 100
"""Heals per rank before a death goes to the agent (a crash that repeats at one step would loop)."""
SPARE_AFTER_ARMED_S = 3.0
"""How long the training process runs armed before its spare starts: runs shorter than this (tests,
smoke runs, most of a test suite's) never start one, and a longer run's spare imports while the
first steps' compilation and warm-up are over."""
SPARE_IDLE_AT_MOST_S = 10.0
"""How long a spare imports at idle priority before it is given a normal share of the CPU. Under
SCHED_IDLE a spare gets no CPU at all while the training keeps every core busy (CPU training, or a
shared host): it would never be ready, and each heal would start cold. A run that goes on this
long pays the spare's 1-2 s of CPU once, as every run did before spares started lazily."""
ENV_SPARE_AFTER_S = "SLIPSTREAM_HEAL_SPARE_AFTER_S"
"""Overrides ``SPARE_AFTER_ARMED_S`` (seconds; 0: as soon as armed): for tests and benchmarks."""
ENV_SPARE_IDLE_S = "SLIPSTREAM_HEAL_SPARE_IDLE_S"
"""Overrides ``SPARE_IDLE_AT_MOST_S`` (seconds): for tests."""
_ARMED_POLL_S = 0.2
"""How often the supervisor looks for the armed file until the spare is started (a stat: no cost)."""
_FORWARDED = (signal.SIGTERM, signal.SIGINT)


class Spare:
    """A started ``slipstream.launch.spare`` process, waiting on its stdin for what to run."""

    def __init__(self, env: dict[str, str], idle: bool = False, now: bool = False) -> None:
        """``idle``: import at the lowest CPU priority (a spare made ahead, beside the training).
        ``now``: activated at once (the first training process, or a replacement with no spare
        ready): nothing to import ahead of the order, so the script imports only what it needs."""
        argv = ([sys.executable, "-u", "-m", "slipstream.launch.spare"] + (["--idle"] if idle else [])
                + (["--now"] if now else []))
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, close_fds=True)
        self.idle = idle

    def normal_priority(self) -> None:
        """Give a spare made at idle priority a normal share of the CPU (every thread of it)."""
        if self.idle and hasattr(os, "SCHED_OTHER") and self.proc.poll() is None:
            set_policy(os.SCHED_OTHER, self.proc.pid)
        self.idle = False

    def activate(self, argv: list[str], replacement: bool) -> subprocess.Popen:
        self.normal_priority()  # a replacement now: a spare still importing finishes at a normal share
        stdin: IO[bytes] = self.proc.stdin  # type: ignore[assignment]
        stdin.write((json.dumps({"argv": argv, "replacement": replacement}) + "\n").encode())
        stdin.close()
        return self.proc

    def discard(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def supervise(argv: list[str]) -> int:
    """Run ``argv`` (the worker's script and arguments) in a child, replacing it in place when it
    dies armed; returns the exit code to end with (a signal's death is re-raised on this process)."""
    die_with_agent()
    env = os.environ
    rank = env.get("RANK", "?")
    spares = int(env.get(heal_env.SPARES) or 1)
    timing = _SpareTiming(float(env.get(ENV_SPARE_AFTER_S) or SPARE_AFTER_ARMED_S),
                          float(env.get(ENV_SPARE_IDLE_S) or SPARE_IDLE_AT_MOST_S))
    limit = DEFAULT_HEAL_LIMIT
    armed_file = os.path.join(tempfile.gettempdir(), f"slipstream-heal-{os.getpid()}.armed")
    child_env = dict(env)
    child_env.update({
        heal_env.CHILD: "1",
        heal_env.ARMED_FILE: armed_file,
        ENV_AGENT_PID: str(os.getpid()),  # the child dies with this supervisor
        ENV_OWNER: str(os.getppid()),  # its snapshots belong to the launcher, as without a supervisor
    })
    pid_dir = env.get(heal_env.PID_DIR)
    pid_file = os.path.join(pid_dir, f"rank{rank}.pid") if pid_dir else None
    state: dict = {"active": None, "stopping": False}

    def forward(signum: int, _frame: object) -> None:
        state["stopping"] = True
        active = state["active"]
        if active is not None and active.poll() is None:
            os.kill(active.pid, signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    warm: Spare | None = Spare(child_env, now=True)
    replacement, heals = False, 0
    try:
        while True:
            assert warm is not None
            child = warm.activate(argv, replacement)
            state["active"], warm = child, None
            if pid_file:
                _write(pid_file, str(child.pid))
            rc, warm = _wait(child, armed_file, spares > 0, timing, child_env, state)
            armed = os.path.exists(armed_file)
            _remove(armed_file)
            if state["stopping"] or rc >= 0 or not armed or heals >= limit:
                if rc < 0 and armed and heals >= limit and not state["stopping"]:
                    log.info(f"[slipstream] rank {rank}: the training process died ({_signal_name(rc)}) after "
                             f"{heals} heals in place, the limit: the launcher restarts every worker", extra=CONSOLE)
                return rc
            heals += 1
            replacement = True
            how = ("a warm spare" if warm is not None else "a new process (no spare left)" if spares == 0 else
                   f"a new process (the spare starts {timing.after_armed_s:g} s after the training process arms)")
            log.info(f"[slipstream] rank {rank}: the training process (pid {child.pid}) died ({_signal_name(rc)}); "
                     f"replacing it in place with {how}, heal {heals}", extra=CONSOLE)
            if warm is None:
                warm = Spare(child_env, now=True)
    finally:
        if warm is not None:
            warm.discard()
        _remove(armed_file)


@dataclass(frozen=True)
class _SpareTiming:
    after_armed_s: float  # SPARE_AFTER_ARMED_S
    idle_at_most_s: float  # SPARE_IDLE_AT_MOST_S


def _wait(child: subprocess.Popen, armed_file: str, want_spare: bool, timing: _SpareTiming,
          child_env: dict[str, str], state: dict) -> tuple[int, Spare | None]:
    """Wait for ``child`` to end; meanwhile, when ``want_spare``, start the spare (idle priority) once
    the child has been armed ``timing.after_armed_s``, and give it a normal priority
    ``timing.idle_at_most_s`` later. Returns (the child's exit code, the spare or None)."""
    armed_at: float | None = None
    while want_spare:
        try:
            return child.wait(timeout=_ARMED_POLL_S), None
        except subprocess.TimeoutExpired:
            pass
        if state["stopping"]:
            break
        if armed_at is None and os.path.exists(armed_file):
            armed_at = time.monotonic()
        if armed_at is not None and time.monotonic() - armed_at >= timing.after_armed_s:
            made = Spare(child_env, idle=True)  # the next replacement imports torch now, not at the failure
            try:
                try:
                    return child.wait(timeout=timing.idle_at_most_s), made
                except subprocess.TimeoutExpired:
                    made.normal_priority()  # done importing or not: it must be ready for the next failure
                return child.wait(), made
            except BaseException:
                made.discard()
                raise
    return child.wait(), None


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def exit_like(rc: int) -> None:
    """End this process as the child ended: with its code, or killed by its signal."""
    if rc < 0:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            signal.signal(-rc, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and SIGSTOP take no handler: their default stands
            pass
        os.kill(os.getpid(), -rc)
    sys.exit(rc if rc >= 0 else 128 - rc)
