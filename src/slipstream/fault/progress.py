"""Where is every rank? Heartbeats through the rendezvous store, and a hang report.

Each rank's training loop marks its phase (forward, backward with the gradient
all-reduce, optimizer, checkpoint, user code between steps) with a plain
attribute write. A daemon thread publishes ``{step, phase, t}`` to the job's
c10d store about once a second. When a collective fails or times out on one
rank, that rank reads every rank's last record from the store and says who
stalled first and where, e.g.::

    collective timed out on rank 0 in backward (gradient all-reduce) of step 42 after 10.0 s.
    rank 1 stalled first: last seen in user code after step 41, 9.8 s ago (never reached the
    gradient all-reduce of step 42). Where each rank was: rank 0: backward (gradient
    all-reduce) of step 42, 0.4 s ago; rank 1: user code after step 41, 9.8 s ago.

The same goes into RUN_DIR/hang.json and RUN_DIR/hang.txt.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch.distributed as dist

from ..errors import SlipstreamError

_PREFIX = "slipstream/progress/"

# Phase names, in the order a step passes through them.
FORWARD = "forward"
BACKWARD = "backward (gradient all-reduce)"
BACKWARD_LOCAL = "backward (accumulating, no all-reduce)"
OPTIMIZER = "optimizer step"
CHECKPOINT = "checkpoint"
METRICS = "metrics exchange (straggler detection)"
USER = "user code between steps"


class CollectiveTimeout(SlipstreamError):
    """A collective failed or hung; the message names the rank that stalled first."""

    exit_code = 1


def is_collective_failure(exc: BaseException) -> bool:
    """True for the errors gloo/NCCL raise when a peer hangs or dies."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(
        marker in text
        for marker in ("Timed out", "timed out", "Connection closed by peer", "Connection reset", "NCCL", "Gloo")
    )


class ProgressReporter:
    """Publishes this rank's (step, phase) to the store from a daemon thread."""

    def __init__(self, rank: int, world_size: int, interval_s: float = 1.0, store: Any = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.step = 0
        self.phase = USER
        self._since = time.time()
        self._store = store if store is not None else _default_store()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._store is not None:
            self._publish()
            self._thread = threading.Thread(target=self._run, name="slipstream-progress", daemon=True)
            self._thread.start()

    def mark(self, phase: str, step: int | None = None) -> None:
        """Record the phase this rank enters (cheap: two attribute writes)."""
        if step is not None:
            self.step = step
        if phase != self.phase:
            self.phase = phase
            self._since = time.time()

    def _publish(self) -> None:
        record = {"step": self.step, "phase": self.phase, "since": self._since, "t": time.time(), "pid": os.getpid()}
        self._store.set(f"{_PREFIX}{self.rank}", json.dumps(record))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the store is gone (peer died): stop quietly
                return

    def close(self) -> None:
        self._stop.set()
        # Joined: a daemon thread killed inside a store call at interpreter
        # exit can abort the process ("terminate called without an active exception").
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def read_all(self) -> dict[int, dict | None]:
        """Every rank's last record (None where the store has nothing or is gone)."""
        out: dict[int, dict | None] = {}
        for r in range(self.world_size):
            try:
                key = f"{_PREFIX}{r}"
                # check() does not wait for a missing key, get() would.
                out[r] = json.loads(self._store.get(key)) if self._store is not None and self._store.check([key]) else None
            except Exception:  # noqa: BLE001
                out[r] = None
        return out


def _default_store() -> Any:
    if not dist.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - a backend without a store: no heartbeats
        return None


def _where(record: dict | None, now: float) -> str:
    if record is None:
        return "no heartbeat (process gone or store unreachable)"
    if record["phase"] == USER:
        where = f"{record['phase']} after step {record['step']}"
    else:
        where = f"{record['phase']} of step {record['step'] + 1}"
    return f"{where} for {now - record['since']:.1f} s (heartbeat {now - record['t']:.1f} s ago)"


def diagnose_hang(
    reporter: ProgressReporter, error: BaseException, timeout_s: float, run_dir: str | None
) -> CollectiveTimeout:
    """Build the hang report, write it to the run directory, and return the error to raise.

    Heartbeats are read twice, a few intervals apart: a rank whose heartbeat
    did not advance is gone (killed, or frozen whole); among the live ones,
    the rank furthest behind stalled first.
    """
    reporter.close()
    first = reporter.read_all()
    time.sleep(1.5 * reporter.interval_s)
    records = reporter.read_all()
    now = time.time()
    me = reporter.rank
    records[me] = {"step": reporter.step, "phase": reporter.phase, "since": reporter._since, "t": now}
    gone = [
        r for r in records
        if r != me and (records[r] is None or (first.get(r) is not None and records[r]["t"] <= first[r]["t"]))
    ]
    live = {r: rec for r, rec in records.items() if r not in gone and rec is not None}
    behind = sorted(live.items(), key=lambda kv: (kv[1]["step"], kv[1]["phase"] != USER, kv[1]["since"]))
    mine = f"{reporter.phase} of step {reporter.step + 1}"
    if gone:
        r = gone[0]
        last = records[r]
        seen = f"; its last heartbeat: {_where(last, now)}" if last else ""
        culprit = f"rank {r} failed first: its heartbeat stopped (process gone or frozen){seen}"
    elif behind and behind[0][0] != me:
        r, rec = behind[0]
        culprit = f"rank {r} stalled first: last seen in {_where(rec, now)}"
        if rec["step"] <= reporter.step and reporter.phase != USER:
            culprit += f" (it never reached the {reporter.phase} of step {reporter.step + 1})"
    else:
        culprit = "no rank is behind the others: the collective itself hung (network or backend)"
    lines = [
        f"collective failed on rank {me} in {mine} (timeout {timeout_s:g} s): "
        f"{str(error).strip().splitlines()[0][:200]}",
        culprit + ".",
        "Where each rank was: "
        + "; ".join(f"rank {r}: {'gone' if r in gone else _where(rec, now)}" for r, rec in sorted(records.items()))
        + ".",
    ]
    message = "\n".join(lines)
    if run_dir:
        try:
            os.makedirs(run_dir, exist_ok=True)
            with open(os.path.join(run_dir, "hang.txt"), "w", encoding="utf-8") as f:
                f.write(message + "\n")
            with open(os.path.join(run_dir, "hang.json"), "w", encoding="utf-8") as f:
                json.dump(
                    {"reporting_rank": me, "phase": reporter.phase, "step": reporter.step + 1,
                     "timeout_s": timeout_s, "error": str(error)[:2000], "culprit": culprit, "gone": gone,
                     "ranks": {str(r): rec for r, rec in records.items()}, "time_unix_s": now},
                    f, indent=1,
                )
        except OSError:
            pass
    return CollectiveTimeout(message)
