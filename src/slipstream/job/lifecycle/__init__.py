"""``slipstream status | logs | cancel JOB``: one request type, dispatched to Slurm or Kubernetes.

Modules: :mod:`.model` (types, pure helpers), :mod:`.slurm`, :mod:`.k8s`, :mod:`.cli` (the parsers).

JOB is a name or engine id from a submission record (:mod:`slipstream.job.submissions`, written by
``slipstream submit``), which also says where the job runs. Without a record, the
target says it: ``--target slurm`` with a Slurm job id, ``--target kubernetes`` (or a
manifest flavour such as ``jobset``) with a job name.

Example::

    st = status(LifecycleRequest(action=Action.STATUS, job="gpt-small"))
    print(format_status(st))   # state, nodes, requeues, elapsed, last step and loss
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TextIO

from ...errors import ConfigError
from ..submissions import SubmissionNotFound, find_submission
from . import k8s, slurm
from .model import Engine, JobRef, JobStatus, format_status

K8S_FLAVOURS = tuple(k8s.FLAVOURS)
TARGETS = ("slurm", "kubernetes", *K8S_FLAVOURS)


class Action(Enum):
    STATUS = "status"
    LOGS = "logs"
    CANCEL = "cancel"


@dataclass(frozen=True)
class LifecycleRequest:
    """One ``slipstream status|logs|cancel`` invocation.

    ``target``: None (from the submission record), ``slurm``, ``kubernetes`` (the
    default manifest flavour, ``indexed-job``) or a flavour. ``rank``: logs of one
    rank only. ``run_dir``: where to read the last step and loss from, overriding
    the record's.
    """

    action: Action
    job: str
    target: str | None = None
    kubectl: str = "kubectl"
    namespace: str | None = None
    follow: bool = False
    rank: int | None = None
    run_dir: str | None = None

    def __post_init__(self) -> None:
        if self.target is not None and self.target not in TARGETS:
            raise ConfigError(f"--target: must be one of {', '.join(TARGETS)}, got {self.target!r}")
        if self.rank is not None and self.rank < 0:
            raise ConfigError(f"--rank: must be >= 0, got {self.rank}")
        if not self.job.strip():
            raise ConfigError("JOB: must be a job name or id, got an empty string")


def _engine(target: str) -> Engine:
    return Engine.SLURM if target == "slurm" else Engine.KUBERNETES


def resolve(req: LifecycleRequest) -> JobRef:
    """The job the request names: from its submission record, else from ``--target``.

    With both a record and ``--target``, the record is used only when it is for the
    same engine (a Slurm id and a Kubernetes name may coincide).
    """
    try:
        sub = find_submission(req.job)
    except SubmissionNotFound:
        if req.target is None:
            raise
        sub = None
    if sub is not None and (req.target is None or _engine(req.target) is _engine(sub.target)):
        flavour = "" if sub.target == "slurm" else (req.target if req.target in K8S_FLAVOURS else sub.target)
        return JobRef(engine=_engine(sub.target), job_id=sub.engine_id, name=sub.name, flavour=flavour,
                      namespace=req.namespace or sub.namespace, run_dir=req.run_dir or sub.run_dir,
                      submitted_at=None if req.run_dir else sub.submitted_at - 5)  # 5 s: clock and mtime rounding
    assert req.target is not None
    engine = _engine(req.target)
    if engine is Engine.SLURM and not req.job.replace("_", "").isdigit():
        raise ConfigError(f"JOB: with --target slurm and no submission record, a Slurm job id (digits), got {req.job!r}")
    return JobRef(engine=engine, job_id=req.job, name=req.job if engine is Engine.KUBERNETES else "",
                  flavour="" if engine is Engine.SLURM else (req.target if req.target in K8S_FLAVOURS else ""),
                  namespace=req.namespace, run_dir=req.run_dir)


def status(req: LifecycleRequest) -> JobStatus:
    """The job's state, nodes, restarts/requeues, elapsed time and the run's last step and loss."""
    ref = resolve(req)
    return slurm.status(ref) if ref.engine is Engine.SLURM else k8s.status(ref, req.kubectl)


def logs(req: LifecycleRequest, out: TextIO) -> int:
    """Write the job's output to ``out`` (``req.follow``: until the job ends); returns the exit code."""
    ref = resolve(req)
    if ref.engine is Engine.SLURM:
        return slurm.logs(ref, out, follow=req.follow, rank=req.rank)
    return k8s.logs(ref, out, kubectl=req.kubectl, follow=req.follow, rank=req.rank)


def cancel(req: LifecycleRequest) -> str:
    """Cancel the job; returns the line that says what happened."""
    ref = resolve(req)
    return slurm.cancel(ref) if ref.engine is Engine.SLURM else k8s.cancel(ref, req.kubectl)


__all__ = ["Action", "LifecycleRequest", "TARGETS", "cancel", "format_status", "logs", "resolve", "status"]
