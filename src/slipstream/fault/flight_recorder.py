"""Hang diagnosis from torch's flight recorder: works when NCCL kills the process.

On NCCL a hung collective never raises in Python: the watchdog thread finds
the timeout and, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` at its default, tears
the process down (SIGABRT). The in-process diagnosis of :mod:`.progress`
therefore never runs there. torch's flight recorder fills the gap: every rank
keeps a ring buffer of its last collectives (process group, sequence number,
op, sizes, state, Python stack), and on a watchdog timeout the rank that timed
out signals the others through the store so that *every* rank writes its buffer
to ``<prefix><global rank>`` before the process dies. The files outlive the
processes, so the launcher (or anyone, later) can read them and name the rank
that never entered the collective the others are waiting in::

    collective #42 (all_reduce, 1 tensor of [8388608] Float) of process group 0 (default_pg) hung:
    rank 1 never entered it; its last collective there was #41 (all_reduce) from train.py:88 (train_step).
    rank(s) 0, 2, 3 wait in it for 661.2 s from train.py:88 (train_step).

Two pieces:

* :func:`configure_flight_recorder` gives the environment a rank needs before
  its process group is created (buffer size, dump on timeout, dump location
  in the run directory, the heartbeat monitor);
* :func:`diagnose_flight_recorder` reads the dumps of a run directory, writes
  ``RUN_DIR/hang.txt`` and ``hang.json`` (the files the in-process diagnosis
  writes on gloo) and returns the verdict; :func:`analyze_traces` is the pure
  part, for dumps already loaded. When the ranks' progress reporters also
  wrote ``RUN_DIR/progress/rank<R>.json``, the report adds where each rank's
  host code was (step and phase), which the device-side trace cannot say.

Traces and progress files are read from the run directory, so on several
nodes it must be shared (or the diagnosis sees only the local ranks).

The dump format is the pickle torch's ``FlightRecorder::dump`` writes (the one
``torch.distributed.flight_recorder.fr_trace`` reads): a dict with
``version``, ``pg_config`` ({pg name: {"name", "desc", "ranks": "[0, 1]"}}),
``pg_status`` ({str(pg id): {"last_enqueued_collective",
"last_started_collective", "last_completed_collective"}}) and ``entries``
(one dict per recorded op: ``pg_id``, ``process_group`` (name, desc),
``collective_seq_id``, ``p2p_seq_id``, ``is_p2p``, ``profiling_name``
("nccl:all_reduce"), ``input_sizes``, ``input_dtypes``, ``state``
("scheduled" | "started" | "completed"), ``retired``, ``time_created_ns``,
``frames``, ...). torch 2.13's CPU build records gloo collectives in the same
format (``TORCH_FR_BUFFER_SIZE``), which is how the tests check the reader on a
real dump.
"""

from __future__ import annotations

import ast
import os
import pickle
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TRACE_DIRNAME = "flight_recorder"
# Where ProgressReporter(progress_dir=RUN_DIR/progress) writes each rank's last (step, phase).
PROGRESS_DIRNAME = "progress"
TRACE_PREFIX = "nccl_trace_rank_"

# Entries kept per rank. torchtitan keeps 20000; a few thousand cover the last
# several steps of even a deeply sharded model (FSDP2 issues ~2 collectives per
# layer per step), and each entry holds a Python stack captured at enqueue time.
DEFAULT_BUFFER_ENTRIES = 2000
# The heartbeat monitor kills a rank whose NCCL watchdog thread made no progress
# for this long (a CUDA or NCCL call that never returns). torch's default is
# 480 s; after a timeout the watchdog itself sleeps 4 x the dump wait (15 s by
# default, so 60 s) to let every rank write its trace, so the monitor's limit
# must stay well above 60 s or it would cut the dumps short. 180 s keeps that
# margin and still frees a wedged job 5 minutes sooner.
DEFAULT_HEARTBEAT_TIMEOUT_S = 180


def trace_prefix(run_dir: str) -> str:
    """The dump path prefix under ``run_dir`` (a rank's file is the prefix + its global rank).

    Example::

        trace_prefix("runs/x")   # "runs/x/flight_recorder/nccl_trace_rank_"
    """
    return os.path.join(run_dir, TRACE_DIRNAME, TRACE_PREFIX)


def configure_flight_recorder(
    run_dir: str | None,
    *,
    buffer_entries: int = DEFAULT_BUFFER_ENTRIES,
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Environment defaults that make every rank record its collectives and dump them on a timeout.

    Returns only the variables ``environ`` (default ``os.environ``) does not
    set already, so a user's own choice wins; the caller sets them before
    ``init_process_group`` (torch reads them when the process group and its
    flight recorder are created). Creates ``RUN_DIR/flight_recorder/`` (torch
    writes the dump files but does not create their directory). With
    ``run_dir`` None the traces go to torch's default place (under
    ``~/.cache/torch``), where :func:`diagnose_flight_recorder` cannot find them.

    Example::

        os.environ.update(configure_flight_recorder(os.environ.get("SLIPSTREAM_RUN_DIR")))
        dist.init_process_group("nccl", ...)
    """
    env = os.environ if environ is None else environ
    if buffer_entries <= 0:
        raise ValueError(f"buffer_entries must be > 0, got {buffer_entries}")
    wanted = {
        # torch 2.13 reads TORCH_FR_BUFFER_SIZE first, for NCCL and gloo alike, and
        # warns that the older TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated.
        "TORCH_FR_BUFFER_SIZE": str(buffer_entries),
        # The default changed across torch releases: say it.
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        # The monitor thread is what notices the other ranks' dump signal and what
        # kills a rank whose watchdog is stuck in a CUDA call; the dump needs it on.
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(int(heartbeat_timeout_s)),
    }
    if run_dir is not None:
        prefix = trace_prefix(run_dir)
        os.makedirs(os.path.dirname(prefix), exist_ok=True)
        # Read before its older name TORCH_NCCL_DEBUG_INFO_TEMP_FILE (torch 2.13).
        wanted["TORCH_FR_DUMP_TEMP_FILE"] = prefix
    # A user who set the older name of a variable chose its value: setting the
    # newer name would override it.
    older = {"TORCH_FR_BUFFER_SIZE": "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"}
    wanted = {k: v for k, v in wanted.items() if k not in older or older[k] not in env}
    return {k: v for k, v in wanted.items() if k not in env}


# --- reading -------------------------------------------------------------------------------


def read_traces(directory: str, prefix: str = TRACE_PREFIX) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
    """Load every ``<prefix><rank>`` dump in ``directory``.

    Returns (dumps by global rank, errors by rank for files that could not be
    read: a rank killed while writing leaves a truncated pickle). The files
    are pickles written by this job's own ranks (as torch's fr_trace reads
    them); do not point this at files from elsewhere.

    Example::

        dumps, bad = read_traces("runs/x/flight_recorder")
    """
    dumps: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    if not os.path.isdir(directory):
        return dumps, errors
    for name in sorted(os.listdir(directory)):
        suffix = name[len(prefix):] if name.startswith(prefix) else ""
        if not suffix.isdigit():
            continue
        rank = int(suffix)
        try:
            with open(os.path.join(directory, name), "rb") as f:
                dump = pickle.load(f)
            if not isinstance(dump, dict) or "entries" not in dump and "pg_status" not in dump:
                raise ValueError("not a flight recorder dump")
            dumps[rank] = dump
        except Exception as exc:  # noqa: BLE001 - one bad file must not hide the others
            errors[rank] = f"{type(exc).__name__}: {exc}"
    return dumps, errors


# --- analysis ------------------------------------------------------------------------------


@dataclass
class _GroupView:
    """One rank's view of one process group, from its dump."""

    name: str
    desc: str
    last_enqueued: int | None  # None: unknown (the ring buffer lost this group's entries)
    last_started: int
    last_completed: int
    entries: list[dict[str, Any]] = field(default_factory=list)  # this group's collectives, oldest first


@dataclass
class FlightRecorderVerdict:
    """What the dumps say: the ranks to blame and why.

    ``culprits``: global ranks that caused the hang (never entered the
    collective the others wait in, wrote no trace, or never started it on the
    GPU); empty when every rank entered and the collective itself hung.
    ``message``: the report, a few lines. ``group``/``seq``/``op``: the hung
    collective. ``ranks``: per rank and group, the sequence numbers read.
    """

    culprits: list[int]
    message: str
    group: str | None = None
    seq: int | None = None
    op: str | None = None
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)


def _parse_ranks(text: Any) -> list[int] | None:
    if isinstance(text, (list, tuple)):
        return [int(r) for r in text]
    try:
        value = ast.literal_eval(str(text))
        return [int(r) for r in value]
    except (ValueError, SyntaxError, TypeError):
        return None


def _completed(entry: dict[str, Any]) -> bool:
    # gloo records no device events, so its entries stay "scheduled"; "retired"
    # (the work finished and left the watchdog's list) says completed for both.
    return entry.get("state") == "completed" or bool(entry.get("retired"))


def _started(entry: dict[str, Any]) -> bool:
    return entry.get("state") in ("started", "completed") or entry.get("time_discovered_started_ns") is not None


def _views(dump: dict[str, Any]) -> dict[str, _GroupView]:
    """Per process-group progress of one rank, keyed by the group's name (global across ranks)."""
    entries = [e for e in dump.get("entries") or [] if isinstance(e, dict)]
    status = dump.get("pg_status") or {}
    by_name: dict[str, _GroupView] = {}
    pg_ids: dict[str, int] = {}
    has_p2p: set[str] = set()
    for e in entries:
        name, desc = (list(e.get("process_group") or ("?", "?")) + ["?"])[:2]
        name = str(name)
        view = by_name.setdefault(name, _GroupView(str(name), str(desc), None, -1, -1))
        if "pg_id" in e:
            pg_ids[name] = int(e["pg_id"])
        if e.get("is_p2p"):
            has_p2p.add(name)
            continue
        seq = int(e.get("collective_seq_id", -1))
        view.entries.append(e)
        view.last_enqueued = max(view.last_enqueued if view.last_enqueued is not None else -1, seq)
        if _started(e):
            view.last_started = max(view.last_started, seq)
        if _completed(e):
            view.last_completed = max(view.last_completed, seq)
    for name, view in by_name.items():
        st = status.get(str(pg_ids.get(name, -1)))
        # pg_status counts p2p ops in the same sequence on some releases: use it
        # only for groups that carry collectives alone.
        if isinstance(st, Mapping) and name not in has_p2p:
            view.last_enqueued = max(view.last_enqueued or -1, int(st.get("last_enqueued_collective", -1)))
            view.last_started = max(view.last_started, int(st.get("last_started_collective", -1)))
            view.last_completed = max(view.last_completed, int(st.get("last_completed_collective", -1)))
        # A completed collective was also enqueued and started.
        view.last_started = max(view.last_started, view.last_completed)
        if view.last_enqueued is not None:
            view.last_enqueued = max(view.last_enqueued, view.last_started)
    return by_name


def _buffer_complete(dump: dict[str, Any]) -> bool:
    """True when the ring buffer still holds this rank's first record (record ids start at 0)."""
    entries = dump.get("entries") or []
    return not entries or int(entries[0].get("record_id", 1)) == 0


def _where(entry: dict[str, Any] | None) -> str:
    """The user's call site of an entry: its first stack frame outside torch."""
    if not entry:
        return ""
    for frame in entry.get("frames") or []:
        filename = str(frame.get("filename", ""))
        if f"{os.sep}torch{os.sep}" in filename or filename.startswith("<"):
            continue
        return f" from {os.path.basename(filename)}:{frame.get('line')} ({frame.get('name')})"
    return ""


def _op(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "?"
    return str(entry.get("profiling_name", "?")).split(":", 1)[-1]


def _describe(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "?"
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    shown = ", ".join(str(list(s)) for s in sizes[:3]) + (", ..." if len(sizes) > 3 else "")
    n = len(sizes)
    return f"{_op(entry)}, {n} tensor{'s' if n != 1 else ''} of {shown} {dtypes[0] if dtypes else ''}".rstrip()


def _entry(view: _GroupView | None, seq: int) -> dict[str, Any] | None:
    if view is None:
        return None
    for e in reversed(view.entries):
        if int(e.get("collective_seq_id", -1)) == seq:
            return e
    return None


def analyze_traces(
    dumps: Mapping[int, Mapping[str, Any]], world_size: int | None = None, now_ns: int | None = None
) -> FlightRecorderVerdict | None:
    """Name the rank(s) that stalled, from flight-recorder dumps keyed by global rank.

    For every process group, the first collective some rank has not completed
    is the hung one (its sequence number is ``min(last completed) + 1``). A
    member whose last enqueued collective is older never entered it: that rank
    stalled (user code, data loading, a different collective). When every
    member entered it, a member without a dump (it died first) or one whose GPU
    never started it (with start events recorded) is blamed; else the
    collective itself hung. Among groups, the one whose pending collective was
    entered first is reported (the later ones wait behind it). Returns None
    when no group has a pending collective.

    Example::

        dumps, _ = read_traces("runs/x/flight_recorder")
        verdict = analyze_traces(dumps, world_size=8)
        print(verdict.culprits, verdict.message)
    """
    views = {rank: _views(dict(d)) for rank, d in dumps.items()}
    complete = {rank: _buffer_complete(dict(d)) for rank, d in dumps.items()}
    groups: dict[str, tuple[str, list[int] | None]] = {}
    for rank, d in dumps.items():
        for name, cfg in (d.get("pg_config") or {}).items():
            if isinstance(cfg, Mapping):
                members = _parse_ranks(cfg.get("ranks"))
                groups.setdefault(str(name), (str(cfg.get("desc", "")), members))
        for name, view in views[rank].items():
            if name not in groups or groups[name][1] is None:
                groups[name] = (view.desc, groups.get(name, ("", None))[1])
    candidates = []
    for name, (desc, members) in groups.items():
        seen = [r for r in views if name in views[r]]
        if not seen:
            continue  # a group no dump has collectives of
        if members is None:
            # gloo names its config entry differently from its entries: the world
            # group's members are every rank; another group's are the ranks seen.
            members = list(range(world_size)) if desc == "default_pg" and world_size else sorted(seen)
        progress: dict[int, _GroupView | None] = {}
        for r in members:
            if r not in views:
                continue
            view = views[r].get(name)
            if view is None and complete[r]:
                # Its whole history is in the buffer and holds no collective of this group.
                view = _GroupView(name, desc, -1, -1, -1)
            progress[r] = view
        known = {r: v for r, v in progress.items() if v is not None and v.last_enqueued is not None}
        if not known:
            continue
        # Sequence numbers start at 1 (0 and -1 both mean "none yet").
        pending = min(max(v.last_completed, 0) for v in known.values()) + 1
        if max(v.last_enqueued for v in known.values()) < pending:  # type: ignore[type-var]
            continue  # everything anyone entered has completed everywhere
        entered = {r: v for r, v in known.items() if v.last_enqueued >= pending}  # type: ignore[operator]
        first = min(
            (e for v in entered.values() if (e := _entry(v, pending)) is not None),
            key=lambda e: int(e.get("time_created_ns") or 0),
            default=None,
        )
        unknown = sorted(r for r, v in progress.items() if v is None or v.last_enqueued is None)
        candidates.append((int(first.get("time_created_ns") or 0) if first else 0, name, desc, members, known,
                           entered, pending, first, unknown))
    if not candidates:
        return None
    candidates.sort(key=lambda c: c[0])
    created_ns, name, desc, members, known, entered, seq, first, unknown = candidates[0]
    missing = sorted(r for r in known if r not in entered)
    no_dump = sorted(r for r in members if r not in dumps)
    start_known = any(v.last_started >= seq for v in entered.values())
    not_started = sorted(r for r, v in entered.items() if start_known and v.last_started < seq)
    group = f"process group {name}" + (f" ({desc})" if desc and desc != "undefined" else "")
    head = f"collective #{seq} ({_describe(first)}) of {group} hung:"
    lines = [head]
    if missing:
        culprits = missing
        for r in missing:
            v = known[r]
            entered_any = v.last_enqueued is not None and v.last_enqueued > 0
            last = _entry(v, v.last_enqueued) if entered_any else None  # type: ignore[arg-type]
            before = (
                f"its last collective there was #{v.last_enqueued} ({_op(last)}){_where(last)}"
                if entered_any else "it entered none of that group's collectives"
            )
            lines.append(f"rank {r} never entered it; {before}.")
    elif no_dump:
        culprits = no_dump
        lines.append(
            f"every rank that wrote a trace entered it; rank(s) {', '.join(map(str, no_dump))} wrote none "
            "(the process died before the timeout, or could not dump)."
        )
    elif not_started:
        culprits = not_started
        lines.append(
            f"rank(s) {', '.join(map(str, not_started))} entered it but their GPU never started it "
            "(the stream was blocked by earlier work on that rank)."
        )
    elif unknown:
        culprits = []
        lines.append(
            f"cannot tell who is behind: the traces of rank(s) {', '.join(map(str, unknown))} no longer reach this "
            "group's collectives (their ring buffer wrapped; raise TORCH_FR_BUFFER_SIZE)."
        )
    else:
        culprits = []
        lines.append("every rank entered it and none finished: the collective itself hung (network or NCCL).")
    waiting = sorted(entered)
    if waiting:
        ago = ""
        if now_ns is not None and created_ns:
            ago = f" for {(now_ns - created_ns) / 1e9:.1f} s"
        lines.append(f"rank(s) {', '.join(map(str, waiting))} wait in it{ago}{_where(first)}.")
    if no_dump and culprits != no_dump:
        lines.append(f"no trace from rank(s) {', '.join(map(str, no_dump))}.")
    ranks = {
        r: {n: {"last_enqueued": v.last_enqueued, "last_started": v.last_started, "last_completed": v.last_completed}
            for n, v in views[r].items()}
        for r in sorted(views)
    }
    return FlightRecorderVerdict(culprits, "\n".join(lines), group=name, seq=seq, op=_op(first), ranks=ranks)


def diagnose_flight_recorder(
    run_dir: str, world_size: int | None = None, *, write: bool = True, archive: bool = True
) -> FlightRecorderVerdict | None:
    """Read ``RUN_DIR/flight_recorder/``, name the stalled rank, write ``hang.txt`` / ``hang.json``.

    For the launcher, after a worker died (an NCCL timeout ends in SIGABRT).
    With ``archive`` the dumps read are moved to ``flight_recorder/attempt-<unix
    time>/`` so that a later failure (after a restart) is judged on its own
    dumps. Returns None when there are no dumps or none shows a pending collective.

    Example::

        verdict = diagnose_flight_recorder("runs/x", world_size=8)
        if verdict is not None:
            print(verdict.message)
    """
    from .progress import describe_progress, read_progress_files, write_hang_report

    directory = os.path.join(run_dir, TRACE_DIRNAME)
    dumps, errors = read_traces(directory)
    if not dumps and not errors:
        return None
    verdict = analyze_traces(dumps, world_size, now_ns=time.time_ns())
    if verdict is not None and errors:
        verdict.message += "\nunreadable traces: " + "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    beats = read_progress_files(os.path.join(run_dir, PROGRESS_DIRNAME))
    if verdict is not None and beats:
        # The host side of the story: on NCCL the device runs behind the host, so a
        # rank's phase says where its Python code was, and the trace where its GPU was.
        now = time.time()
        verdict.message += "\nhost code of each rank (last heartbeat): " + "; ".join(
            f"rank {r}: {describe_progress(rec, now)}" for r, rec in sorted(beats.items())
        ) + "."
    if verdict is not None and write:
        write_hang_report(
            run_dir,
            "flight recorder: " + verdict.message,
            {"source": "flight_recorder", "culprit": verdict.message.splitlines()[1] if "\n" in verdict.message else "",
             "culprits": verdict.culprits, "group": verdict.group, "seq": verdict.seq, "op": verdict.op,
             "ranks": {str(r): v for r, v in verdict.ranks.items()}, "unreadable": {str(r): e for r, e in errors.items()},
             "time_unix_s": time.time()},
        )
    if archive:
        dest = os.path.join(directory, f"attempt-{time.time_ns()}")
        os.makedirs(dest, exist_ok=True)
        for r in sorted(set(dumps) | set(errors)):
            src = os.path.join(directory, f"{TRACE_PREFIX}{r}")
            if os.path.exists(src):
                shutil.move(src, os.path.join(dest, f"{TRACE_PREFIX}{r}"))
    return verdict


__all__ = [
    "DEFAULT_BUFFER_ENTRIES",
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "PROGRESS_DIRNAME",
    "FlightRecorderVerdict",
    "analyze_traces",
    "configure_flight_recorder",
    "diagnose_flight_recorder",
    "read_traces",
    "trace_prefix",
]
