"""``slipstream status|logs|cancel`` on Slurm: squeue, sacct, scontrol, scancel.

Where the state comes from:

* a live job (pending, running, completing): ``squeue``;
* a finished one: ``sacct``; on clusters without accounting
  (``AccountingStorageType=accounting_storage/none``, where sacct answers "Slurm
  accounting storage is disabled") ``scontrol show job``, which keeps a finished
  job for ``MinJobAge`` seconds (300 by default);
* requeues (``Restarts=``) and the output file (``StdOut=``): ``scontrol show job``.

Example::

    ref = JobRef(engine=Engine.SLURM, job_id="42", name="gpt")
    status(ref).state   # 'RUNNING'
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from typing import TextIO

from ...errors import SlipstreamError, UsageError
from .model import (
    RANK_PREFIX_HINT, Engine, JobNotFound, JobRef, JobStatus, call, filter_rank, first_line, last_metrics,
    line_rank, note, parse_duration_s,
)

TIMEOUT_S = 30.0
_INSTALL = "install the Slurm client commands (Debian: apt-get install slurm-client) or run this on a login node"
_UNREACHABLE = ("unable to contact slurm controller", "connection refused", "connect failure",
                "could not establish a configuration source", "unable to establish controller")
_SQUEUE_FORMAT = "%i|%j|%T|%N|%D|%M|%r"
LIVE_STATES = frozenset({"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED",
                         "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"})


class CancelFailed(SlipstreamError):
    """scancel reached the controller and was refused."""

    exit_code = 1


def _tool(argv: list[str]) -> subprocess.CompletedProcess:
    proc = call(argv, timeout_s=TIMEOUT_S, what="Slurm", install_hint=_INSTALL)
    err = (proc.stderr or "").lower()
    if proc.returncode != 0 and any(h in err for h in _UNREACHABLE):
        raise UsageError(f"no Slurm controller reachable ({argv[0]} said: {first_line(proc.stderr)}); "
                         "check SLURM_CONF and that slurmctld runs")
    return proc


def _invalid_id(proc: subprocess.CompletedProcess) -> bool:
    return proc.returncode != 0 and "invalid job id" in (proc.stderr or "").lower()


def squeue_row(job_id: str) -> dict[str, str] | None:
    """The job's squeue row (id, name, state, nodes, node count, time, reason), or None when not live."""
    proc = _tool(["squeue", "-h", "-j", job_id, "-o", _SQUEUE_FORMAT])
    if _invalid_id(proc):
        return None
    if proc.returncode != 0:
        raise UsageError(f"squeue -j {job_id} failed: {first_line(proc.stderr or proc.stdout)}")
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 7 and parts[0].split("_")[0] == job_id.split("_")[0]:
            return dict(zip(("id", "name", "state", "nodes", "num_nodes", "time", "reason"), parts))
    return None


def parse_scontrol(line: str) -> dict[str, str]:
    """``scontrol show job -o`` (one line of ``Key=Value`` pairs; values may hold spaces) as a dict.

    Example::

        parse_scontrol("JobId=4 JobName=my job JobState=RUNNING")   # {'JobId': '4', 'JobName': 'my job', ...}
    """
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r"(?:^|\s)([A-Za-z][\w:/]*)=(.*?)(?=\s[A-Za-z][\w:/]*=|$)", line.strip())}


def scontrol_job(job_id: str) -> dict[str, str] | None:
    """``scontrol show job -o ID`` as a dict, or None when the controller no longer knows the job."""
    proc = _tool(["scontrol", "show", "job", "-o", job_id])
    if _invalid_id(proc):
        return None
    if proc.returncode != 0:
        raise UsageError(f"scontrol show job {job_id} failed: {first_line(proc.stderr or proc.stdout)}")
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("JobId=")), None)
    return parse_scontrol(line) if line else None


def sacct_row(job_id: str) -> tuple[dict[str, str] | None, str | None]:
    """(the job's sacct row, None) or (None, why sacct could not say)."""
    proc = _tool(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "JobID,JobName,State,NodeList,NNodes,Elapsed,ExitCode"])
    text = (proc.stderr + proc.stdout).strip()
    if "accounting storage is disabled" in text.lower():
        return None, "no accounting on this cluster"
    if proc.returncode != 0:
        return None, f"sacct: {first_line(text)}"
    for line in proc.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 7 and parts[0] == job_id:
            return dict(zip(("id", "name", "state", "nodes", "num_nodes", "elapsed", "exit_code"), parts)), None
    return None, "sacct does not know it"


def _nodes(nodelist: str, count: str) -> tuple[str, ...]:
    if not nodelist or nodelist in ("(null)", "None assigned", "None"):
        return ()
    return (f"{nodelist} ({count} node{'s' if count != '1' else ''})" if count else nodelist,)


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def status(ref: JobRef) -> JobStatus:
    """The job's state, nodes, requeues, elapsed time, and the run's last step and loss.

    Raises :class:`JobNotFound` when neither squeue, sacct nor scontrol know the job.
    """
    job_id = ref.job_id
    live = squeue_row(job_id)
    detail = scontrol_job(job_id)
    restarts = _int(detail.get("Restarts")) if detail else None
    log_path = detail.get("StdOut") if detail else None
    metrics = last_metrics(ref.run_dir, ref.submitted_at)
    common = dict(engine=Engine.SLURM, job_id=job_id, restarts=restarts, log_path=log_path, metrics=metrics)
    if live is not None:
        return JobStatus(name=ref.name or live["name"], state=live["state"], nodes=_nodes(live["nodes"], live["num_nodes"]),
                         elapsed_s=parse_duration_s(live["time"]), reason=live["reason"], source="squeue", **common)
    acct, why = sacct_row(job_id)
    if acct is not None:
        state = acct["state"].split()[0]  # "CANCELLED by 0" -> CANCELLED
        return JobStatus(name=ref.name or acct["name"], state=state, nodes=_nodes(acct["nodes"], acct["num_nodes"]),
                         elapsed_s=parse_duration_s(acct["elapsed"]), exit_code=acct["exit_code"], source="sacct",
                         **common)
    if detail is not None:
        return JobStatus(name=ref.name or detail.get("JobName", ""), state=detail.get("JobState", "UNKNOWN"),
                         nodes=_nodes(detail.get("NodeList", ""), detail.get("NumNodes", "")),
                         elapsed_s=parse_duration_s(detail.get("RunTime", "")), reason=detail.get("Reason"),
                         exit_code=detail.get("ExitCode"), source=f"scontrol; {why}", **common)
    raise JobNotFound(f"Slurm does not know job {job_id}: not in squeue, {why}, and scontrol no longer keeps it "
                      "(finished jobs stay there for MinJobAge, 300 s by default)")


def _log_file(ref: JobRef) -> tuple[str, dict[str, str]]:
    detail = scontrol_job(ref.job_id)
    if detail is None:
        raise JobNotFound(f"Slurm no longer knows job {ref.job_id} (finished more than MinJobAge ago?), "
                          f"so where its output went is unknown; look for slurm-{ref.job_id}.out in its working directory")
    path = detail.get("StdOut", "")
    if not path or path == "(null)":
        raise UsageError(f"job {ref.job_id} has no output file (StdOut={path or 'unset'})")
    if "%" in path:  # a pattern scontrol did not expand (arrays: %A_%a)
        path = path.replace("%j", ref.job_id).replace("%A", ref.job_id.split("_")[0])
    return path, detail


def _live(job_id: str) -> bool:
    row = squeue_row(job_id)
    return row is not None and row["state"] in LIVE_STATES


def logs(ref: JobRef, out: TextIO, *, follow: bool = False, rank: int | None = None, poll_s: float = 0.5) -> int:
    """Print the job's output file (``StdOut`` of ``scontrol show job``); with ``follow``, until the job ends.

    ``rank``: only the lines tagged with that rank (see :func:`~.model.line_rank`).
    The file is read where this command runs: on a shared file system, or on the batch node.
    """
    path, detail = _log_file(ref)
    state = detail.get("JobState", "")
    if not follow:
        if not os.path.exists(path):
            if state in LIVE_STATES:
                note(f"no output yet: job {ref.job_id} is {state}; {path} does not exist")
                return 0
            raise UsageError(f"output file {path} of job {ref.job_id} not found on this host "
                             f"(the job ran on {detail.get('BatchHost', '?')}: is the file system shared?)")
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        _emit(lines, rank, out)
        return 0
    return _follow(ref.job_id, path, out, rank, poll_s)


def _emit(lines: list[str], rank: int | None, out: TextIO) -> None:
    for line in filter_rank(lines, rank):
        out.write(line + "\n")
    out.flush()
    if rank is not None and lines and not any(line_rank(ln) is not None for ln in lines):
        note(RANK_PREFIX_HINT)


def _follow(job_id: str, path: str, out: TextIO, rank: int | None, poll_s: float) -> int:
    pos, partial, tagged, ended = 0, "", False, False
    next_check = 0.0
    while True:
        if not ended and time.monotonic() >= next_check:
            ended = not _live(job_id)  # checked before the last read, so no line written at the end is lost
            next_check = time.monotonic() + max(poll_s, 1.0)
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
                pos += len(chunk)
        except FileNotFoundError:
            chunk = b""
        text = partial + chunk.decode("utf-8", errors="replace")
        *lines, partial = text.split("\n")
        if ended and partial:
            lines, partial = [*lines, partial], ""
        tagged = tagged or any(line_rank(ln) is not None for ln in lines)
        for line in filter_rank(lines, rank):
            out.write(line + "\n")
        out.flush()
        if ended:
            break
        time.sleep(poll_s)
    if rank is not None and not tagged:
        note(RANK_PREFIX_HINT)
    return 0


def cancel(ref: JobRef, wait_s: float = 10.0) -> str:
    """``scancel`` the job and wait (up to ``wait_s``) to see it CANCELLED; returns the line to print.

    A job that has already finished is left alone (the line says so).
    """
    row = squeue_row(ref.job_id)
    if row is None or row["state"] not in LIVE_STATES:
        st = status(ref)
        return f"job {ref.job_id} has already finished ({st.state}); nothing to cancel"
    proc = _tool(["scancel", ref.job_id])
    if proc.returncode != 0:
        raise CancelFailed(f"scancel {ref.job_id} failed: {first_line(proc.stderr or proc.stdout)}")
    deadline = time.monotonic() + wait_s
    state = row["state"]
    while time.monotonic() < deadline:
        detail = scontrol_job(ref.job_id)
        state = detail.get("JobState", "") if detail else "CANCELLED"
        if state not in LIVE_STATES:
            break
        time.sleep(0.2)
    name = f" ({ref.name})" if ref.name and ref.name != ref.job_id else ""
    if state in LIVE_STATES:
        return f"cancel requested for Slurm job {ref.job_id}{name}; still {state} after {wait_s:.0f} s"
    return f"cancelled Slurm job {ref.job_id}{name}: {state}"
