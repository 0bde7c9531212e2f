"""The moving parts of the chaos harness (benchmarks/chaos.py): a watched launcher and the faults.

``Launch`` starts ``python -m slipstream run ...`` in a session of its own and
reads its console in a thread: every ``[slipstream] step N |`` (or ``step N/TOTAL |``) line rank 0
prints is kept with the monotonic time it arrived, so a fault can wait for a
step and the harness can time fault -> next step. Each fault function acts on
a live ``Launch`` and returns a :class:`FaultRecord`; nothing here decides
whether a trial passed.

Linux only (/proc, inotify); the link cut needs root and network namespaces.
"""

from __future__ import annotations

import ctypes
import os
import random
import re
import select
import signal
import struct
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from slipstream.launch.proc import kill_tree

STEP_RE = re.compile(r"^\[slipstream\] step (\d+)(?:/\d+)? \|")
RESUMED_RE = re.compile(r"resumed from .* at step (\d+)")
PARTIAL_RE = re.compile(r"^step_(\d+)\.partial$")


@dataclass
class FaultRecord:
    """One injected fault, as it went."""

    kind: str
    planned_step: int
    injected: bool = False
    step: int | None = None
    """Last step rank 0 had logged when the fault struck."""
    at_s: float | None = None
    """When it struck, seconds since the trial began."""
    rank: int | None = None
    pid: int | None = None
    launcher_exit: int | None = None
    """For launcher faults: the exit code of the launcher that was hit."""
    orphans: int = 0
    """Workers of a killed or preempted launcher still alive 2 s after it ended."""
    orphan_pids: list[int] = field(default_factory=list)
    to_next_step_s: float | None = None
    """From the fault to the next step line any launcher of the trial logged after it."""
    resumed_from: int | None = None
    """The checkpoint step the job resumed from after this fault."""
    note: str = ""
    t_mono: float | None = None

    def public(self) -> dict:
        d = dict(self.__dict__)
        d.pop("t_mono")
        return d


class Launch:
    """One ``slipstream run`` process whose console is read line by line (stdout and stderr together)."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str], cwd: str) -> None:
        self.argv = argv
        self.log = open(log_path, "a", encoding="utf-8", errors="replace")
        self.log.write(f"$ {' '.join(argv)}\n")
        self.log.flush()
        self.steps: list[tuple[float, int]] = []
        self.resumes: list[tuple[float, int]] = []
        """(time, step) of every "resumed from ... at step N" line (a restart inside this launch included)."""
        self.cond = threading.Condition()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                     env=env, cwd=cwd, start_new_session=True, bufsize=1)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.monotonic()
            self.log.write(line)
            m = STEP_RE.match(line)
            r = RESUMED_RE.search(line)
            with self.cond:
                if m:
                    self.steps.append((now, int(m.group(1))))
                if r:
                    self.resumes.append((now, int(r.group(1))))
                self.cond.notify_all()
        self.log.flush()
        with self.cond:
            self.cond.notify_all()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def last_step(self) -> int | None:
        with self.cond:
            return self.steps[-1][1] if self.steps else None

    def wait_step(self, at_least: int, after_t: float, deadline: float) -> int | None:
        """Block until a step >= ``at_least`` is logged after ``after_t``; None when the run ends or time runs out."""
        with self.cond:
            while True:
                for t, s in reversed(self.steps):
                    if t <= after_t:
                        break
                    if s >= at_least:
                        return s
                if self.proc.poll() is not None and not self.reader.is_alive():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(left, 0.2))

    def first_resume_after(self, t: float) -> tuple[float, int] | None:
        with self.cond:
            return next(((ts, s) for ts, s in self.resumes if ts > t), None)

    def first_step_after(self, t: float) -> float | None:
        with self.cond:
            for ts, _ in self.steps:
                if ts > t:
                    return ts
        return None

    def wait(self, timeout_s: float) -> int | None:
        """The exit code; None (and the whole tree killed) when it ran past ``timeout_s``."""
        try:
            code = self.proc.wait(timeout=max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        self.reader.join(timeout=10)
        self.log.flush()
        return code

    def kill(self) -> None:
        kill_tree(self.proc.pid)  # the workers lead sessions of their own: walk the tree
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.reader.join(timeout=5)
        self.log.flush()

    def close(self) -> None:
        if self.alive():
            self.kill()
        self.log.close()


# -- processes -----------------------------------------------------------------------

def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/<pid>/task/*/children); [] when it is gone."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except (OSError, ValueError):
            continue  # a thread that ended between the listing and the open
    return out


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        k, _, v = item.partition(b"=")
        env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def is_live_worker(pid: int) -> bool:
    """Alive (not a zombie) and running slipstream's worker entry point."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X") and b"slipstream.launch.worker" in cmdline


def workers(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the launcher's live workers (children running slipstream.launch.worker)."""
    found = {}
    for pid in children(launcher_pid):
        if is_live_worker(pid):
            rank = _environ(pid).get("RANK")
            if rank is not None and rank.isdigit():
                found[int(rank)] = pid
    return found


def wait_workers(launch: Launch, world: int, deadline: float) -> dict[int, int]:
    """The launcher's workers once all ``world`` are up (a restart may be in flight); what is there at the deadline."""
    while True:
        found = workers(launch.pid)
        if len(found) >= world or time.monotonic() >= deadline or not launch.alive():
            return found
        time.sleep(0.02)


def reap_orphans(pids: list[int], grace_s: float = 2.0) -> list[int]:
    """Of ``pids`` (workers of a launcher that ended), those still alive ``grace_s`` later; then kills them."""
    time.sleep(grace_s)
    orphans = [p for p in pids if is_live_worker(p)]
    for p in orphans:
        kill_tree(p)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(is_live_worker(p) for p in orphans):
        time.sleep(0.05)
    return orphans


# -- faults --------------------------------------------------------------------------

def worker_kill(launch: Launch, rec: FaultRecord, rng: random.Random, world: int, t0: float) -> None:
    """SIGKILL one random rank's worker; the launcher (--max-restarts) restarts the group."""
    found = wait_workers(launch, world, time.monotonic() + 5)
    if not found:
        rec.note = "no live worker to kill"
        return
    rank = rng.choice(sorted(found))
    rec.rank, rec.pid, rec.step = rank, found[rank], launch.last_step()
    try:
        os.kill(found[rank], signal.SIGKILL)
    except ProcessLookupError:
        rec.note = "the worker was already gone"
        return
    rec.t_mono = time.monotonic()
    rec.at_s, rec.injected = rec.t_mono - t0, True


def launcher_kill(launch: Launch, rec: FaultRecord, t0: float) -> None:
    """SIGKILL the launcher itself (a node agent dying); workers alive 2 s later are orphans."""
    pids = list(workers(launch.pid).values())
    rec.pid, rec.step = launch.pid, launch.last_step()
    os.kill(launch.pid, signal.SIGKILL)
    rec.t_mono = time.monotonic()
    rec.at_s, rec.injected = rec.t_mono - t0, True
    rec.launcher_exit = launch.wait(30)
    rec.orphan_pids = reap_orphans(pids)
    rec.orphans = len(rec.orphan_pids)


def launcher_sigterm(launch: Launch, rec: FaultRecord, t0: float, timeout_s: float) -> None:
    """SIGTERM the launcher (preemption): expected an emergency checkpoint, then exit 143."""
    pids = list(workers(launch.pid).values())
    rec.pid, rec.step = launch.pid, launch.last_step()
    os.kill(launch.pid, signal.SIGTERM)
    rec.t_mono = time.monotonic()
    rec.at_s, rec.injected = rec.t_mono - t0, True
    rec.launcher_exit = launch.wait(timeout_s)
    if rec.launcher_exit is None:
        rec.note = f"the preempted launcher did not exit within {timeout_s:.0f} s (tree killed)"
    elif rec.launcher_exit != 143:
        rec.note = f"expected exit 143 after SIGTERM, got {rec.launcher_exit}"
    rec.orphan_pids = reap_orphans(pids)
    rec.orphans = len(rec.orphan_pids)


class DirWatch:
    """New entries of a directory, as they appear: inotify (IN_CREATE | IN_MOVED_TO) when the
    libc has it, else a 2 ms poll. Saves of a small model take milliseconds, so a poll of
    tens of milliseconds would mostly see them already renamed."""

    IN_CREATE, IN_MOVED_TO = 0x100, 0x80

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1
        self.seen = set(os.listdir(path))
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0 and libc.inotify_add_watch(fd, str(path).encode(), self.IN_CREATE | self.IN_MOVED_TO) >= 0:
                self.fd = fd
            elif fd >= 0:
                os.close(fd)
        except (OSError, AttributeError):
            self.fd = -1

    def next_name(self, pattern: re.Pattern, deadline: float, still: callable) -> str | None:
        """The first new entry matching ``pattern``; None at the deadline or once ``still()`` is false."""
        while time.monotonic() < deadline and still():
            if self.fd >= 0:
                ready, _, _ = select.select([self.fd], [], [], 0.1)
                if not ready:
                    continue
                try:
                    buf = os.read(self.fd, 65536)
                except BlockingIOError:
                    continue
                off = 0
                while off + 16 <= len(buf):
                    _, _, _, length = struct.unpack_from("iIII", buf, off)
                    name = buf[off + 16: off + 16 + length].split(b"\0", 1)[0].decode(errors="replace")
                    off += 16 + length
                    if pattern.match(name):
                        return name
            else:
                names = set(os.listdir(self.path))
                for name in sorted(names - self.seen):
                    if pattern.match(name):
                        return name
                self.seen = names
                time.sleep(0.002)
        return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def kill_in_save(launch: Launch, rec: FaultRecord, rng: random.Random, world: int, ckpt: Path, t0: float,
                 deadline: float) -> None:
    """SIGKILL a random worker the moment a ``step_N.partial`` directory appears (a save in flight).

    Records whether the save was still incomplete at the kill (step_N not yet renamed into place).
    """
    ckpt.mkdir(parents=True, exist_ok=True)
    watch = DirWatch(ckpt)
    try:
        found = wait_workers(launch, world, time.monotonic() + 5)
        name = watch.next_name(PARTIAL_RE, deadline, launch.alive)
        if name is None:
            rec.note = "no save began before the run ended"
            return
        found = workers(launch.pid) or found
        rank = rng.choice(sorted(found)) if found else None
        if rank is None:
            rec.note = "no live worker to kill"
            return
        try:
            os.kill(found[rank], signal.SIGKILL)
        except ProcessLookupError:
            rec.note = "the worker was already gone"
            return
        rec.t_mono = time.monotonic()
        save_step = int(PARTIAL_RE.match(name).group(1))
        complete = (ckpt / f"step_{save_step:08d}").exists()
        rec.rank, rec.pid, rec.step = rank, found[rank], launch.last_step()
        rec.at_s, rec.injected = rec.t_mono - t0, True
        rec.note = f"save of step {save_step} was {'already complete' if complete else 'in flight'} at the kill"
    finally:
        watch.close()


def link_cut(launch: Launch, rec: FaultRecord, ns_prefix: str, node: int, cut_s: float, t0: float) -> None:
    """Unplug emulated node ``node``'s port from the switch's bridge for ``cut_s`` seconds
    (what EmulatedCluster.cut_link/restore_link do; the cluster lives in the launcher process,
    so this finds its switch namespace by the run's unique prefix)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    switches = [line.split()[0] for line in out.splitlines() if line.startswith(ns_prefix) and "-sw" in line.split()[0]]
    if not switches:
        rec.note = f"no emulated switch namespace {ns_prefix}*-sw found"
        return
    sw, port = switches[0], f"ssp{node}"
    rec.rank, rec.step = node, launch.last_step()
    subprocess.run(["ip", "-n", sw, "link", "set", "dev", port, "nomaster"], check=True, timeout=10)
    rec.t_mono = time.monotonic()
    rec.at_s, rec.injected = rec.t_mono - t0, True
    time.sleep(cut_s)
    subprocess.run(["ip", "-n", sw, "link", "set", "dev", port, "master", "ssbr"], check=False, timeout=10)
    rec.note = f"node {node} cut off for {cut_s:.1f} s"
