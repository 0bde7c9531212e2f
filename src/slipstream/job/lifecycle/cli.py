"""``slipstream status | logs | cancel JOB``: the parsers; the work is :mod:`slipstream.job.lifecycle`'s."""

from __future__ import annotations

import argparse
import os
import re
import sys

from ...names import REFUSED
from . import TARGETS, Action, LifecycleRequest, cancel, format_status, logs, status

_JOB_HELP = ("job name or id from `slipstream submit` (its record says where it runs); "
             "without a record, a Slurm job id with --target slurm or a job name with --target kubernetes")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", metavar="JOB", help=_JOB_HELP)
    p.add_argument("--target", choices=TARGETS, default=None,
                   help="where the job runs (default: from the submission record); kubernetes means indexed-job")
    p.add_argument("--kubectl", default="kubectl", metavar="PATH", help="kubectl to use (default: kubectl on PATH)")
    p.add_argument("--namespace", default=None, metavar="NS",
                   help="Kubernetes namespace (default: the record's, else kubectl's current one)")
    # -n is processes per node everywhere (run, bench): here it is refused with the flag to use.
    p.add_argument("-n", dest="refused_n", action=_Refused, default=None, help=argparse.SUPPRESS)


class _Refused(argparse.Action):
    """A flag that would give a name a second meaning (slipstream.names.REFUSED): one line naming the live one."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        entry = next(r for r in REFUSED if r.old == option_string and parser.prog.split()[-1] in r.commands)
        raise argparse.ArgumentError(self, f"{entry.why}; write {entry.new} {values}")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status", help="state, nodes, restarts, elapsed time and progress of a submitted job",
        description="Show a submitted job: state (Slurm's words, on Kubernetes too), nodes, requeues/restarts, "
        "elapsed time, and the last step and loss from the run's metrics when its run directory is reachable.",
    )
    _common(p)
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="read the last step and loss from DIR/metrics (default: the record's run directory)")
    p.set_defaults(func=main, action=Action.STATUS)

    p = subparsers.add_parser(
        "logs", help="print (or follow) a submitted job's output",
        description="Print the job's output: its Slurm output file, or every pod's log on Kubernetes.",
    )
    _common(p)
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--rank", type=int, default=None, metavar="R",
                   help="only lines tagged with rank R ([rankR]:, [defaultR]: or srun --label's 'R: ')")
    p.set_defaults(func=main, action=Action.LOGS)

    p = subparsers.add_parser(
        "cancel", help="cancel a submitted job (scancel, or kubectl delete)",
        description="Cancel the job: scancel on Slurm (and wait to see it CANCELLED); on Kubernetes, "
        "delete its objects by label (the pods go with them).",
    )
    _common(p)
    p.set_defaults(func=main, action=Action.CANCEL)


_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
"""A Kubernetes namespace: an RFC 1123 label (lower case, digits, '-', at most 63)."""


def check_lifecycle_args(args: argparse.Namespace) -> None:
    """--namespace and --run-dir, before any cluster is asked: flag, rule and value."""
    from ...errors import UsageError

    if args.namespace is not None and not _NAMESPACE.fullmatch(args.namespace):
        raise UsageError("--namespace must be a Kubernetes namespace (lower-case letters, digits and '-', "
                         f"at most 63), got {args.namespace!r}")
    run_dir = getattr(args, "run_dir", None)
    if run_dir is not None and os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise UsageError(f"--run-dir must be a run directory, got a file: {run_dir}")


def main(args: argparse.Namespace) -> int:
    check_lifecycle_args(args)
    req = LifecycleRequest(
        action=args.action, job=args.job, target=args.target, kubectl=args.kubectl, namespace=args.namespace,
        follow=getattr(args, "follow", False), rank=getattr(args, "rank", None), run_dir=getattr(args, "run_dir", None),
    )
    if req.action is Action.STATUS:
        print(format_status(status(req)))
        return 0
    if req.action is Action.LOGS:
        return logs(req, sys.stdout)
    print(cancel(req))
    return 0
