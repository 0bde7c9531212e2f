"""The types and pure helpers shared by ``slipstream status|logs|cancel`` and its two engines.

:mod:`slipstream.job.lifecycle` turns a request into a :class:`JobRef` and dispatches to
:mod:`.slurm` or :mod:`.k8s`; both return a :class:`JobStatus`
and use :func:`call` to run the engine's command-line tools, so a missing tool or
an unreachable cluster is the same one line (exit 2) everywhere.

Example::

    st = JobStatus(engine=Engine.SLURM, job_id="42", name="gpt", state="RUNNING", nodes=("n1", "n2"))
    format_status(st).splitlines()[1]   # 'state:    RUNNING'
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Iterator, Sequence

from ...errors import SlipstreamError, UsageError
from ...log import CONSOLE

log = logging.getLogger(__name__)


class Engine(Enum):
    """Where a job runs."""

    SLURM = "slurm"
    KUBERNETES = "kubernetes"


class JobNotFound(SlipstreamError):
    """The cluster does not know the job (exit 2)."""


@dataclass(frozen=True)
class JobRef:
    """One job on one engine: what the lifecycle commands act on.

    ``job_id`` is the engine's id (the Slurm job id; on Kubernetes the job name,
    which is also the value of the ``slipstream.dev/job`` label). ``flavour`` is
    the Kubernetes manifest target (``indexed-job``, ``jobset``, ...), empty on Slurm.
    """

    engine: Engine
    job_id: str
    name: str
    flavour: str = ""
    namespace: str | None = None
    run_dir: str | None = None
    submitted_at: float | None = None  # from the record: newer runs under run_dir/runs/ are this job's


@dataclass(frozen=True)
class LastMetrics:
    """The newest step record of a run (rank 0's metrics JSONL)."""

    step: int
    loss: float | None
    time_s: float | None
    path: str = ""


@dataclass(frozen=True)
class JobStatus:
    """What ``slipstream status`` prints. ``state`` uses Slurm's words (PENDING, RUNNING,
    COMPLETED, FAILED, CANCELLED, ...), also for Kubernetes jobs, so scripts can match one set."""

    engine: Engine
    job_id: str
    name: str
    state: str
    nodes: tuple[str, ...] = ()
    restarts: int | None = None
    elapsed_s: float | None = None
    reason: str | None = None
    exit_code: str | None = None
    source: str = ""  # the tool the state came from: squeue, sacct, scontrol, kubectl
    log_path: str | None = None
    pods: tuple[str, ...] = ()  # Kubernetes: one "name phase node restarts" line per pod
    metrics: LastMetrics | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def finished(self) -> bool:
        return self.state in FINISHED_STATES


FINISHED_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
    "DEADLINE", "REVOKED", "SPECIAL_EXIT",
})


# ---------------------------------------------------------------------------- tools


def call(argv: Sequence[str], *, timeout_s: float, what: str, install_hint: str) -> subprocess.CompletedProcess:
    """Run an engine's tool (``squeue``, ``kubectl``, ...) and return its result, whatever its exit code.

    A tool missing from PATH or one that does not answer within ``timeout_s`` raises
    :class:`~slipstream.errors.UsageError` (exit 2) with one line naming it.

    Example::

        proc = call(["squeue", "-h", "-j", "42"], timeout_s=30, what="Slurm", install_hint="apt-get install slurm-client")
    """
    exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0])
    if exe is None or not os.path.exists(exe):
        raise UsageError(f"{argv[0]} not found (not on PATH): {what} commands are needed here; {install_hint}")
    try:
        return subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise UsageError(f"{argv[0]} did not answer within {timeout_s:.0f} s: is the {what} cluster reachable?") from None
    except OSError as exc:
        raise UsageError(f"cannot run {exe}: {exc.strerror or exc}") from None


def first_line(text: str) -> str:
    """The first non-empty line of a tool's error output (what a one-line error quotes)."""
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), "(no output)")


# ---------------------------------------------------------------------------- durations


def parse_duration_s(text: str) -> float | None:
    """Slurm's ``[D-]HH:MM:SS``, ``MM:SS`` or ``MM:SS.mmm`` in seconds (None for INVALID/UNLIMITED).

    Example::

        parse_duration_s("1-02:00:05")   # 93605.0
    """
    text = text.strip()
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", text)
    if match is None:
        return None
    days, hours, minutes, seconds = match.groups()
    return int(days or 0) * 86400 + int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds)


def format_duration(seconds: float) -> str:
    """``3725`` -> ``1h02m05s``; ``59.4`` -> ``59s``."""
    s = int(round(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h{m:02d}m"
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


# ---------------------------------------------------------------------------- metrics


def metrics_file(run_dir: str | None, since: float | None = None, rank: int = 0) -> str | None:
    """``RUN_DIR/metrics/rank<R>.jsonl``; else, when RUN_DIR is where the job was submitted
    from and the run picked its own directory (the default ``runs/<timestamp>``), the newest
    ``RUN_DIR/runs/*/metrics/rank<R>.jsonl`` written since ``since``."""
    if not run_dir:
        return None
    direct = os.path.join(run_dir, "metrics", f"rank{rank}.jsonl")
    if os.path.isfile(direct):
        return direct
    found = []
    for path in glob.glob(os.path.join(glob.escape(run_dir), "runs", "*", "metrics", f"rank{rank}.jsonl")):
        try:
            mtime = os.path.getmtime(path)
        except OSError:
            continue
        if since is None or mtime >= since:
            found.append((mtime, path))
    return max(found)[1] if found else None


def last_metrics(run_dir: str | None, since: float | None = None, rank: int = 0,
                 tail_bytes: int = 65536) -> LastMetrics | None:
    """The newest step record of the run's metrics (see :func:`metrics_file`), or None when unreachable.

    Only the file's tail is read: a long run's file grows by a record per log step,
    and status needs the last one. (``slipstream.report.data.load_run`` reads whole
    runs, and the report package sits above the job package, so it is not used here.)

    Example::

        last_metrics("runs/gpt")   # LastMetrics(step=300, loss=2.91, time_s=412.0, path='runs/gpt/metrics/rank0.jsonl')
    """
    path = metrics_file(run_dir, since, rank)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the first line of the tail is usually cut, the last one may be half written
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            loss = rec.get("loss")
            t = rec.get("time_s")
            return LastMetrics(step=rec["step"], loss=float(loss) if isinstance(loss, (int, float)) else None,
                               time_s=float(t) if isinstance(t, (int, float)) else None, path=path)
    return None


# ---------------------------------------------------------------------------- output


def format_status(st: JobStatus) -> str:
    """The text ``slipstream status`` prints: one ``key: value`` line per known fact.

    Example::

        job:      gpt (slurm 42)
        state:    RUNNING
        nodes:    n[1-2] (2)
        restarts: 0
        elapsed:  1m05s
        progress: step 120, loss 3.2140 (run dir /runs/gpt)
    """
    ident = st.job_id if st.name in ("", st.job_id) else f"{st.name}, {st.job_id}"
    lines = [f"job:      {ident} ({st.engine.value}{', ' + st.source if st.source else ''})"]
    state = st.state + (f" ({st.reason})" if st.reason and st.reason not in ("None", "") else "")
    if st.exit_code and st.finished:
        state += f", exit code {st.exit_code}"
    lines.append(f"state:    {state}")
    if st.nodes:
        lines.append(f"nodes:    {', '.join(st.nodes)}")
    if st.restarts is not None:
        word = "requeues" if st.engine is Engine.SLURM else "restarts"
        lines.append(f"{word + ':':<9} {st.restarts}")
    if st.elapsed_s is not None:
        lines.append(f"elapsed:  {format_duration(st.elapsed_s)}")
    for pod in st.pods:
        lines.append(f"pod:      {pod}")
    if st.metrics is not None:
        m = st.metrics
        loss = f", loss {m.loss:.4f}" if m.loss is not None else ""
        lines.append(f"progress: step {m.step}{loss}" + (f" ({m.path})" if m.path else ""))
    if st.log_path:
        lines.append(f"log:      {st.log_path}")
    lines.extend(f"note:     {n}" for n in st.notes)
    return "\n".join(lines)


# Worker-output prefixes that carry a rank, anywhere after kubectl's ``--prefix`` tag:
#   "[rank3]:..."   slipstream run --tee 3 with TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:',
#                   and torch's own per-rank lines
#   "[default3]:..." slipstream run --tee 3 (torch elastic's default template: role + local rank)
#   "3: ..."        srun --label
_RANK_PREFIX = re.compile(r"^(?:\[pod/[^\]]*\] )?(?:\[(?:rank|default)(\d+)\]:|\s*(\d+): )")


def line_rank(line: str) -> int | None:
    """The rank a worker-output line is tagged with, or None for an untagged line.

    Example::

        line_rank("[rank1]:step 5 loss 3.1")   # 1
        line_rank("1: hello")                  # 1 (srun --label)
    """
    match = _RANK_PREFIX.match(line)
    if match is None:
        return None
    return int(match.group(1) if match.group(1) is not None else match.group(2))


def filter_rank(lines: Iterable[str], rank: int | None) -> Iterator[str]:
    """The lines of ``rank`` (all lines when ``rank`` is None)."""
    for line in lines:
        if rank is None or line_rank(line) == rank:
            yield line


def note(message: str) -> None:
    """A line for the user on stderr beside the command's output (``slipstream logs: note: ...``)."""
    log.info("slipstream logs: note: %s", message, extra=CONSOLE)


RANK_PREFIX_HINT = (
    "no line carries a rank prefix, so --rank matched nothing: tag worker lines with "
    "`slipstream run --tee 3` and TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE='[rank${rank}]:' "
    "(or srun --label)"
)
