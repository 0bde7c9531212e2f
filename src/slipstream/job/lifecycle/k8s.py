"""``slipstream status|logs|cancel`` on Kubernetes: ``kubectl get|logs|delete`` by label.

Every object the renderer makes carries ``slipstream.dev/job=NAME``
(:func:`slipstream.job.render._labels`), pod templates included, so the job's
objects and pods are selected with ``-l slipstream.dev/job=NAME``. TrainJob pods
are made by the Trainer's runtime, which does not copy our labels; they carry
``jobset.sigs.k8s.io/jobset-name=NAME`` (the Trainer runs a TrainJob as a JobSet of
the same name).

The argument lists are built by pure functions (unit-tested); every call passes
``--request-timeout`` so an unreachable API server fails in seconds, with one line.

Example::

    ref = JobRef(engine=Engine.KUBERNETES, job_id="gpt", name="gpt", flavour="jobset", namespace="ml")
    get_argv(ref, "kubectl", "pods")
    # ['kubectl', 'get', 'pods', '-l', 'slipstream.dev/job=gpt', '-o', 'json', '-n', 'ml', '--request-timeout=10s']
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
from dataclasses import dataclass
from typing import Any, TextIO

from ...errors import SlipstreamError, UsageError
from ..kubectl import JOB_LABEL, cluster_unreachable
from .model import (
    RANK_PREFIX_HINT, Engine, JobNotFound, JobRef, JobStatus, call, filter_rank, last_metrics, line_rank, note,
)

TRAINJOB_POD_LABEL = "jobset.sigs.k8s.io/jobset-name"
REQUEST_TIMEOUT_S = 10
DEFAULT_FLAVOUR = "indexed-job"
_INSTALL = "install kubectl (https://kubernetes.io/docs/tasks/tools/) or pass --kubectl PATH"
_KLOG = re.compile(r"^[EWIF]\d{4} \d\d:\d\d:\d\d")


@dataclass(frozen=True)
class Flavour:
    """How one manifest target appears in the cluster."""

    resource: str  # what `kubectl get` names the top object by
    delete: tuple[str, ...]  # what `cancel` deletes (the owner deletes the rest)
    pod_label: str  # the label its pods carry the job name in


FLAVOURS = {
    "indexed-job": Flavour("jobs.batch", ("jobs.batch", "services"), JOB_LABEL),
    "jobset": Flavour("jobsets.jobset.x-k8s.io", ("jobsets.jobset.x-k8s.io",), JOB_LABEL),
    "trainjob": Flavour("trainjobs.trainer.kubeflow.org", ("trainjobs.trainer.kubeflow.org",), TRAINJOB_POD_LABEL),
    "pytorchjob": Flavour("pytorchjobs.kubeflow.org", ("pytorchjobs.kubeflow.org",), JOB_LABEL),
}


class KubectlFailed(SlipstreamError):
    """kubectl reached the cluster and the cluster refused the request."""

    exit_code = 1


def flavour(ref: JobRef) -> Flavour:
    return FLAVOURS.get(ref.flavour or DEFAULT_FLAVOUR, FLAVOURS[DEFAULT_FLAVOUR])


def _common(ref: JobRef) -> list[str]:
    ns = ["-n", ref.namespace] if ref.namespace else []
    return [*ns, f"--request-timeout={REQUEST_TIMEOUT_S}s"]


def get_argv(ref: JobRef, kubectl: str, what: str) -> list[str]:
    """``kubectl get`` of the job's top object (``what="job"``) or of its pods (``what="pods"``), as JSON."""
    if what == "pods":
        resource, label = "pods", flavour(ref).pod_label
    else:
        resource, label = flavour(ref).resource, JOB_LABEL
    return [kubectl, "get", resource, "-l", f"{label}={ref.job_id}", "-o", "json", *_common(ref)]


def logs_argv(ref: JobRef, kubectl: str, *, follow: bool, max_pods: int = 64) -> list[str]:
    """``kubectl logs`` of every pod of the job, each line tagged ``[pod/NAME/CONTAINER]``.

    ``--tail=-1``: with a selector kubectl otherwise prints only the last 10 lines.
    No ``--request-timeout`` with ``-f``: it would cut the stream; the caller checks
    the cluster first with a bounded ``kubectl get pods``.
    """
    argv = [kubectl, "logs", "-l", f"{flavour(ref).pod_label}={ref.job_id}", "--all-containers=true", "--prefix",
            "--tail=-1", f"--max-log-requests={max_pods}", "--ignore-errors"]
    if follow:
        return [*argv, "-f", *(["-n", ref.namespace] if ref.namespace else [])]
    return [*argv, *_common(ref)]


def delete_argv(ref: JobRef, kubectl: str) -> list[str]:
    """``kubectl delete`` of the job's objects by label; their pods go with them (owner references)."""
    return [kubectl, "delete", ",".join(flavour(ref).delete), "-l", f"{JOB_LABEL}={ref.job_id}", "--wait=false",
            *_common(ref)]


def kubectl_error(stderr: str) -> str:
    """kubectl's error without its klog lines (``E1130 ... memcache.go ...``), as one line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not _KLOG.match(ln)]
    return lines[0] if lines else next((ln.strip() for ln in stderr.splitlines() if ln.strip()), "(no output)")


def _kubectl(argv: list[str]) -> subprocess.CompletedProcess:
    proc = call(argv, timeout_s=REQUEST_TIMEOUT_S + 20, what="Kubernetes", install_hint=_INSTALL)
    if proc.returncode != 0:
        err = kubectl_error(proc.stderr or proc.stdout)
        low = (proc.stderr or "").lower()
        if cluster_unreachable(low):
            raise UsageError(f"no Kubernetes cluster reachable through kubectl (check your kubeconfig/context): {err}")
        if "doesn't have a resource type" in low:
            raise UsageError(f"the cluster does not know {argv[2]} (its CRD is not installed): {err}")
        raise KubectlFailed(f"{' '.join(argv[1:3])} failed (exit {proc.returncode}): {err}")
    return proc


def _items(proc: subprocess.CompletedProcess) -> list[dict[str, Any]]:
    try:
        data = json.loads(proc.stdout or "{}")
    except ValueError:
        raise KubectlFailed(f"kubectl printed no JSON: {proc.stdout[:200]!r}") from None
    return list(data.get("items", []))


def _time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def job_state(obj: dict[str, Any] | None, pods: list[dict[str, Any]]) -> tuple[str, str | None]:
    """(state in Slurm's words, reason) from the top object's conditions, else from the pods' phases.

    Example::

        job_state({"status": {"conditions": [{"type": "Complete", "status": "True"}]}}, [])   # ("COMPLETED", None)
    """
    conditions = [c for c in ((obj or {}).get("status") or {}).get("conditions") or [] if c.get("status") == "True"]
    types = {c.get("type"): c for c in conditions}
    for kind, state in (("Failed", "FAILED"), ("Complete", "COMPLETED"), ("Completed", "COMPLETED"),
                        ("Succeeded", "COMPLETED"), ("Suspended", "SUSPENDED")):
        if kind in types:
            reason = types[kind].get("reason")
            if state == "FAILED" and reason == "DeadlineExceeded":
                state = "TIMEOUT"
            return state, reason
    phases = [p.get("status", {}).get("phase", "Unknown") for p in pods]
    if "Restarting" in types:
        return "RUNNING", "Restarting"
    if any(ph == "Running" for ph in phases):
        return "RUNNING", None
    if phases and all(ph == "Succeeded" for ph in phases):
        return "COMPLETED", None
    if any(ph == "Failed" for ph in phases) and not any(ph == "Pending" for ph in phases):
        return "FAILED", None
    return "PENDING", ("no pods yet" if not pods else None)


def _restarts(obj: dict[str, Any] | None, pods: list[dict[str, Any]]) -> int:
    status = (obj or {}).get("status") or {}
    replaced = status.get("restarts")  # JobSet: whole-set restarts
    if not isinstance(replaced, int):
        replaced = status.get("failed") if isinstance(status.get("failed"), int) else 0  # Job: failed (replaced) pods
    in_place = sum(int(cs.get("restartCount") or 0) for p in pods
                   for cs in (p.get("status", {}).get("containerStatuses") or []))
    return replaced + in_place


def _elapsed_s(obj: dict[str, Any] | None, now: datetime.datetime) -> float | None:
    if obj is None:
        return None
    status = obj.get("status") or {}
    start = _time(status.get("startTime")) or _time(obj.get("metadata", {}).get("creationTimestamp"))
    end = _time(status.get("completionTime"))
    if end is None:
        final = [c for c in status.get("conditions") or [] if c.get("status") == "True"
                 and c.get("type") in ("Failed", "Complete", "Completed", "Succeeded")]
        end = _time(final[0].get("lastTransitionTime")) if final else None
    return None if start is None else max(0.0, ((end or now) - start).total_seconds())


def summarize(ref: JobRef, objs: list[dict[str, Any]], pods: list[dict[str, Any]],
              now: datetime.datetime | None = None) -> JobStatus:
    """A :class:`JobStatus` from ``kubectl get -o json`` items (pure; unit-tested)."""
    if not objs and not pods:
        where = f" in namespace {ref.namespace}" if ref.namespace else " in kubectl's current namespace"
        raise JobNotFound(f"no {flavour(ref).resource} or pods labelled {JOB_LABEL}={ref.job_id}{where}")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    top = next((o for o in objs if o.get("metadata", {}).get("name") == ref.job_id), objs[0] if objs else None)
    state, reason = job_state(top, pods)
    nodes = tuple(sorted({p.get("spec", {}).get("nodeName") for p in pods} - {None, ""}))
    lines = []
    for p in sorted(pods, key=lambda p: p.get("metadata", {}).get("name", "")):
        st = p.get("status", {})
        restarts = sum(int(cs.get("restartCount") or 0) for cs in st.get("containerStatuses") or [])
        lines.append(f"{p.get('metadata', {}).get('name')} {st.get('phase', 'Unknown')} "
                     f"on {p.get('spec', {}).get('nodeName') or '-'}, {restarts} restart(s)")
    return JobStatus(engine=Engine.KUBERNETES, job_id=ref.job_id, name=ref.name or ref.job_id, state=state,
                     nodes=nodes, restarts=_restarts(top, pods), elapsed_s=_elapsed_s(top, now), reason=reason,
                     source=f"kubectl, {flavour(ref).resource}", pods=tuple(lines),
                     metrics=last_metrics(ref.run_dir, ref.submitted_at))


def status(ref: JobRef, kubectl: str = "kubectl") -> JobStatus:
    """The job's state, nodes, restarts and elapsed time from the cluster."""
    objs = _items(_kubectl(get_argv(ref, kubectl, "job")))
    pods = _items(_kubectl(get_argv(ref, kubectl, "pods")))
    return summarize(ref, objs, pods)


def logs(ref: JobRef, out: TextIO, *, kubectl: str = "kubectl", follow: bool = False, rank: int | None = None) -> int:
    """Print (``follow``: stream) every pod's output; ``rank``: only the lines tagged with that rank."""
    pods = _items(_kubectl(get_argv(ref, kubectl, "pods")))  # bounded: is the cluster there, are there pods
    if not pods:
        raise JobNotFound(f"no pods labelled {flavour(ref).pod_label}={ref.job_id} (yet)"
                          + (f" in namespace {ref.namespace}" if ref.namespace else ""))
    argv = logs_argv(ref, kubectl, follow=follow, max_pods=max(5, len(pods)))
    if not follow:
        proc = _kubectl(argv)
        lines = proc.stdout.splitlines()
        for line in filter_rank(lines, rank):
            out.write(line + "\n")
        _rank_note(rank, lines)
        return 0
    tagged = False  # kubectl is there: the `get pods` above ran it
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            tagged = tagged or line_rank(line) is not None
            if rank is None or line_rank(line) == rank:
                out.write(line + "\n")
                out.flush()
        rc = proc.wait()
    if rank is not None and not tagged:
        _rank_note(rank, [])
    return 0 if rc == 0 else 1


def _rank_note(rank: int | None, lines: list[str]) -> None:
    if rank is not None and not any(line_rank(ln) is not None for ln in lines):
        note(RANK_PREFIX_HINT)


def cancel(ref: JobRef, kubectl: str = "kubectl") -> str:
    """Delete the job's objects (pods follow by owner reference); returns the line to print."""
    proc = _kubectl(delete_argv(ref, kubectl))
    deleted = [ln.strip() for ln in proc.stdout.splitlines() if "deleted" in ln]
    if not deleted:
        where = f" in namespace {ref.namespace}" if ref.namespace else ""
        raise JobNotFound(f"nothing to cancel: no {', '.join(flavour(ref).delete)} labelled "
                          f"{JOB_LABEL}={ref.job_id}{where}")
    return f"cancelled {ref.job_id}: " + "; ".join(deleted)
