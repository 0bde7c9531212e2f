"""``slipstream status | logs | cancel JOB``: one request type, dispatched to Slurm or Kubernetes.

JOB is a name or engine id from a submission record (:mod:`.submissions`, written by
``slipstream submit``), which also says where the job runs. Without a record, the
target says it: ``--target slurm`` with a Slurm job id, ``--target kubernetes`` (or a
manifest flavour such as ``jobset``) with a job name.

Example::

    req = LifecycleRequest(action=Action.STATUS, job="gpt-small")
    run_lifecycle(req, sys.stdout)   # prints state, nodes, requeues, elapsed, last step and loss
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TextIO

from ..errors import ConfigError
from . import lifecycle_k8s, lifecycle_slurm
from .lifecycle_model import Engine, JobRef, format_status
from .submissions import SubmissionNotFound, find_submission

K8S_FLAVOURS = tuple(lifecycle_k8s.FLAVOURS)
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


def run_lifecycle(req: LifecycleRequest, out: TextIO) -> int:
    """Carry out the request, printing to ``out``; returns the exit code (errors raise SlipstreamError)."""
    ref = resolve(req)
    slurm = ref.engine is Engine.SLURM
    if req.action is Action.STATUS:
        st = lifecycle_slurm.status(ref) if slurm else lifecycle_k8s.status(ref, req.kubectl)
        print(format_status(st), file=out)
        return 0
    if req.action is Action.LOGS:
        if slurm:
            return lifecycle_slurm.logs(ref, out, follow=req.follow, rank=req.rank)
        return lifecycle_k8s.logs(ref, out, kubectl=req.kubectl, follow=req.follow, rank=req.rank)
    line = lifecycle_slurm.cancel(ref) if slurm else lifecycle_k8s.cancel(ref, req.kubectl)
    print(line, file=out)
    return 0
