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

This needs the error to reach Python, which gloo does. On NCCL the watchdog
kills the process on a timeout instead; there :mod:`.flight_recorder` reads the
traces every rank dumps and names the rank that never entered the collective.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import torch.distributed as dist

from ..errors import SlipstreamError
from . import reach

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


# What a peer that hung or died looks like from the rank that waited for it. Only
# these count: an error that merely mentions NCCL or gloo ("invalid usage",
# "unhandled cuda error", a user's ValueError quoting a backend name) is a bug to
# report as it is, not a hang to blame on another rank.
_STALL_MARKERS = (
    # gloo, raised as RuntimeError (messages seen here with torch 2.13's gloo):
    #   "[.../unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
    #   "[.../pair.cc:537] Read error [127.0.0.1]:10915: Connection reset by peer. ..."
    "Timed out waiting",
    "Connection reset by peer",
    "Connection closed by peer",
    "Application timeout caused pair closure",
    "failed to pass monitoredBarrier",
    # NCCL (ProcessGroupNCCL.cpp; the CPU build here cannot show them, taken from torch's source):
    #   "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE, ...)"
    #   "Work WorkNCCL(...) timed out in blocking wait" (TORCH_NCCL_BLOCKING_WAIT=1)
    #   "... ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."
    #   "NCCL communicator was aborted on rank 3. Original reason for failure was: ..." (aborted after a timeout)
    "Watchdog caught collective operation timeout",
    "timed out in blocking wait",
    "ncclRemoteError",
    "remote process exited",
    "communicator was aborted",
)


def is_collective_failure(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps) says a peer hung or went away in a collective.

    Counted: torch's ``DistNetworkError`` (a socket to a peer failed) and
    ``DistStoreError`` (a store wait timed out, or the store's host is gone),
    and gloo/NCCL errors whose text is one of the timeout or peer-gone messages
    above. Not counted: other ``DistBackendError`` s (NCCL's invalid usage,
    unhandled CUDA error), and any other exception that merely mentions a backend.

    Example::

        is_collective_failure(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))  # True
        is_collective_failure(ValueError("NCCL needs CUDA tensors"))                                   # False
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    # A wrapper (raise MyError(...) from exc) keeps the real error as __cause__. The
    # implicit __context__ is not followed: an unrelated error raised while handling
    # a timeout that the code chose to retry is not a hang.
    while cur is not None and id(cur) not in seen and len(seen) < 8:
        seen.add(id(cur))
        if _is_stall(cur):
            return True
        cur = cur.__cause__
    return False


def _is_stall(exc: BaseException) -> bool:
    network = getattr(dist, "DistNetworkError", None)
    store = getattr(dist, "DistStoreError", None)
    queue_empty = getattr(dist, "QueueEmptyError", None)  # a DistStoreError from store queues: not a peer
    if network is not None and isinstance(exc, network):
        return True
    if store is not None and isinstance(exc, store) and not (queue_empty is not None and isinstance(exc, queue_empty)):
        return True
    text = str(exc)
    return any(marker in text for marker in _STALL_MARKERS)


class ProgressReporter:
    """Publishes this rank's (step, phase) from a daemon thread: to the job's store, and to
    ``progress_dir/rank<R>.json`` when given.

    The store copy serves the in-process diagnosis (:func:`diagnose_hang`, gloo).
    The file copy outlives the process: on NCCL, where a hung collective kills
    every rank, :func:`~slipstream.fault.flight_recorder.diagnose_flight_recorder`
    reads it beside the flight-recorder traces to say where each rank's host code was.

    Example::

        reporter = ProgressReporter(rank, world_size, progress_dir=os.path.join(run_dir, "progress"))
        reporter.mark(FORWARD, step=41)
    """

    def __init__(
        self, rank: int, world_size: int, interval_s: float = 1.0, store: Any = None, progress_dir: str | None = None
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.interval_s = interval_s
        self.step = 0
        self.phase = USER
        self._since = time.time()
        self._store = store if store is not None else _default_store()
        self._store_live = True
        self._path = os.path.join(progress_dir, f"rank{rank}.json") if progress_dir else None
        if self._path is not None:
            os.makedirs(progress_dir, exist_ok=True)  # type: ignore[arg-type]
        # Where this rank lives, for the report of a peer that stops hearing from it:
        # the node (the launcher's group rank) and the address on the route to the store.
        store_host = os.environ.get("MASTER_ADDR")
        self._node = os.environ.get("GROUP_RANK")
        self._addr = reach.local_address_toward(store_host) if store_host else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._store is not None or self._path is not None:
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
        record = json.dumps(
            {"step": self.step, "phase": self.phase, "since": self._since, "t": time.time(), "pid": os.getpid(),
             "node": self._node, "addr": self._addr}
        )
        if self._path is not None:
            try:
                tmp = f"{self._path}.tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(record)
                os.replace(tmp, self._path)  # a reader never sees half a record
            except OSError:
                self._path = None  # the run directory went away: keep the store copy
        if self._store is not None and self._store_live:
            try:
                self._store.set(f"{_PREFIX}{self.rank}", record)
            except Exception:  # noqa: BLE001 - the store is gone (peer died); the file copy goes on
                self._store_live = False
                if self._path is None:
                    raise

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - nothing left to publish to: stop quietly
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


def _own_record(reporter: ProgressReporter, now: float) -> dict:
    return {"step": reporter.step, "phase": reporter.phase, "since": reporter._since, "t": now,
            "node": reporter._node, "addr": reporter._addr}


def _node_text(record: dict | None) -> str:
    """" (node 1, 198.18.0.2)" from a progress record; "" where it says nothing (a loopback
    address, one machine, names no node)."""
    addr = record.get("addr") if record else None
    parts = [f"node {record['node']}" if record and record.get("node") is not None else "",
             addr if addr and not addr.startswith("127.") else ""]
    parts = [p for p in parts if p]
    return f" ({', '.join(parts)})" if parts else ""


def _why_silent(record: dict | None) -> str:
    """Why a peer's heartbeat stopped, as far as a probe of its address can tell."""
    addr = record.get("addr") if record else None
    if addr:
        answered = reach.answers(addr, int(os.environ.get("MASTER_PORT", "29500")))
        if answered is False:
            return f"its address {addr} does not answer: its node is cut off from the network, or down"
        if answered:
            return f"its address {addr} answers: the process is gone or frozen"
    return "process gone or frozen"


def _store_unreachable() -> str | None:
    """"HOST:PORT" of the rendezvous store when this rank cannot reach it, else None."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not port.isdigit():
        return None
    return f"{host}:{port}" if reach.answers(host, int(port)) is False else None


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
    me = reporter.rank
    cut_off = _store_unreachable()
    if cut_off is not None:
        # This rank's node cannot reach the store: reading it would block for the
        # store's own timeout, and every peer would look gone. Say what is known.
        return _report(reporter, error, timeout_s, run_dir, {me: _own_record(reporter, time.time())}, [],
                       f"rank {me}{_node_text(_own_record(reporter, 0.0))} cannot reach the rendezvous store at "
                       f"{cut_off} (no answer in {reach.PROBE_TIMEOUT_S:g} s): this rank's node is cut off from "
                       f"the others (a link, switch or route failure), not a slow or dead rank")
    first = reporter.read_all()
    time.sleep(1.5 * reporter.interval_s)
    records = reporter.read_all()
    now = time.time()
    records[me] = _own_record(reporter, now)
    gone = [
        r for r in records
        if r != me and (records[r] is None or (first.get(r) is not None and records[r]["t"] <= first[r]["t"]))
    ]
    live = {r: rec for r, rec in records.items() if r not in gone and rec is not None}
    behind = sorted(live.items(), key=lambda kv: (kv[1]["step"], kv[1]["phase"] != USER, kv[1]["since"]))
    if gone:
        r = gone[0]
        last = records[r]
        seen = f"; its last heartbeat: {_where(last, now)}" if last else ""
        culprit = f"rank {r} failed first{_node_text(last)}: its heartbeat stopped ({_why_silent(last)}){seen}"
    elif behind and behind[0][0] != me:
        r, rec = behind[0]
        culprit = f"rank {r} stalled first: last seen in {_where(rec, now)}"
        if rec["step"] <= reporter.step and reporter.phase != USER:
            culprit += f" (it never reached the {reporter.phase} of step {reporter.step + 1})"
    else:
        culprit = "no rank is behind the others: the collective itself hung (network or backend)"
    return _report(reporter, error, timeout_s, run_dir, records, gone, culprit)


def _report(reporter: ProgressReporter, error: BaseException, timeout_s: float, run_dir: str | None,
            records: dict[int, dict | None], gone: list[int], culprit: str) -> CollectiveTimeout:
    now = time.time()
    me = reporter.rank
    mine = f"{reporter.phase} of step {reporter.step + 1}"
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
        write_hang_report(
            run_dir,
            message,
            {"source": "heartbeats", "reporting_rank": me, "phase": reporter.phase, "step": reporter.step + 1,
             "timeout_s": timeout_s, "error": str(error)[:2000], "culprit": culprit, "gone": gone,
             "ranks": {str(r): rec for r, rec in records.items()}, "time_unix_s": now},
        )
    return CollectiveTimeout(message)


def write_hang_report(run_dir: str, message: str, record: dict[str, Any]) -> None:
    """Write ``RUN_DIR/hang.txt`` (the message) and ``RUN_DIR/hang.json`` (the record); best effort.

    The one writer of these files: the in-process diagnosis (heartbeats) and the
    flight-recorder diagnosis both go through it, and ``slipstream report`` reads them.

    Example::

        write_hang_report("runs/x", "rank 1 stalled first.", {"culprit": "rank 1 stalled first"})
    """
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "hang.txt"), "w", encoding="utf-8") as f:
            f.write(message + "\n")
        with open(os.path.join(run_dir, "hang.json"), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1, default=str)
    except OSError:
        pass


def read_progress_files(progress_dir: str) -> dict[int, dict]:
    """The last record each rank's :class:`ProgressReporter` wrote to ``progress_dir``.

    Example::

        read_progress_files("runs/x/progress")   # {0: {"step": 41, "phase": "forward", ...}, 1: {...}}
    """
    out: dict[int, dict] = {}
    if not os.path.isdir(progress_dir):
        return out
    for name in os.listdir(progress_dir):
        rank = name[len("rank"):-len(".json")] if name.startswith("rank") and name.endswith(".json") else ""
        if not rank.isdigit():
            continue
        try:
            with open(os.path.join(progress_dir, name), encoding="utf-8") as f:
                out[int(rank)] = json.load(f)
        except (OSError, ValueError):
            continue
    return out


def describe_progress(record: dict | None, now: float) -> str:
    """Where a rank's host code was, from one progress record, e.g.
    "user code between steps after step 41 for 598.2 s (heartbeat 0.4 s ago)".

    Example::

        describe_progress({"step": 41, "phase": USER, "since": t0, "t": t1}, time.time())
    """
    return _where(record, now)
