"""``slipstream validate | render | submit JOB.yaml``, ``slipstream run JOB.yaml`` and ``slipstream job schema``.

The ``run`` parser (its flags) is the launcher's (launch/cli.py); for a job spec the
top-level command calls :func:`run_main` here, which turns those flags into a
:class:`~slipstream.job.runner.JobRun`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys

from ..config import env_text, replaced
from ..errors import EXIT_USAGE, SlipstreamError, UsageError
from ..launch.cli import RunFlags, heal_settings, parse_rdzv_conf, run_flags, torchrun_option_defaults, worker_env
from .model import config_values
from .kubectl import JOB_LABEL, cluster_unreachable
from .render import DEFAULT_TARGET, TARGETS, TargetUnsupported, render, to_yaml
from .runner import JobRun, run_job
from .spec import JobSpec, load_spec

SLURM = "slurm"
ALL_TARGETS = (*TARGETS, SLURM)
"""Kubernetes targets (manifests) and Slurm (an sbatch script, :mod:`slipstream.job.slurm`)."""


class SubmitFailed(SlipstreamError):
    """kubectl reached the cluster and the cluster refused the manifests."""

    exit_code = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    _add_spec_commands(subparsers)
    job = subparsers.add_parser(
        "job", help="job spec tools: validate, render, submit (also top-level) and the JSON Schema editors use",
        description="Tools around the job spec file: validate, render and submit (the same as the top-level "
        "commands), and schema. Run a job spec with 'slipstream run JOB.yaml'.",
    )
    job.set_defaults(func=lambda _args: _usage(job))
    tools = job.add_subparsers(dest="job_command", metavar="TOOL")
    _add_spec_commands(tools)
    p = tools.add_parser(
        "schema", help="print the job spec's JSON Schema (draft 2020-12)",
        description="Print the JSON Schema of JOB.yaml files, generated from the spec's own rules, for editors "
        "(VS Code: yaml.schemas). The package ships a copy: slipstream/job/schema/jobspec.schema.json.",
    )
    p.add_argument("--out", metavar="PATH", default=None, help="write it to PATH instead of stdout")
    p.set_defaults(func=schema_main)


def _add_spec_commands(subparsers: argparse._SubParsersAction) -> None:
    """validate, render and submit: top-level commands, and the same parsers under ``job``
    (``slipstream job render`` answered "invalid choice": users of other tools group them so)."""
    p = subparsers.add_parser(
        "validate", help="check a job spec and the manifests it renders, offline",
        description="Check JOB.yaml, then render it for every target and check the manifests offline "
        "(kubernetes-validate --strict for core kinds, strict JSON schema for the CRDs, and our own checks; "
        "bash -n for the Slurm script, and sbatch --test-only with --target slurm where a controller answers).",
    )
    p.add_argument("spec", metavar="JOB.yaml")
    p.add_argument("--target", choices=ALL_TARGETS, default=None, help="check only this target (default: all, offline)")
    p.add_argument("--spec-only", action="store_true", help="check the spec file only, not the manifests")
    p.set_defaults(func=validate_main)

    p = subparsers.add_parser(
        "render", help="write the Kubernetes manifests (or the Slurm batch script) for a job spec",
        description="Render JOB.yaml into Kubernetes manifests, or an sbatch script with --target slurm "
        "(checked offline before they are written).",
    )
    p.add_argument("spec", metavar="JOB.yaml")
    p.add_argument("--target", choices=ALL_TARGETS, default=DEFAULT_TARGET,
                   help=f"manifest flavour, or slurm (default {DEFAULT_TARGET})")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="write one file per object (slurm: NAME.sbatch) into DIR (default: stdout)")
    p.add_argument("--skip-validation", action="store_true", help="do not check the manifests (no kubernetes-validate needed)")
    p.set_defaults(func=render_main)

    p = subparsers.add_parser(
        "submit", help="render a job spec and kubectl apply it (or sbatch it with --target slurm)",
        description="Render JOB.yaml, check the manifests offline, and apply them with kubectl; with --target "
        "slurm, check the batch script and submit it with sbatch (from the current directory) and print the job id.",
    )
    p.add_argument("spec", metavar="JOB.yaml")
    p.add_argument("--target", choices=ALL_TARGETS, default=DEFAULT_TARGET,
                   help=f"manifest flavour, or slurm (default {DEFAULT_TARGET})")
    p.add_argument("--dry-run", action="store_true",
                   help="print the manifests (or script) and the command instead of running it (needs no cluster)")
    p.add_argument("--kubectl", default="kubectl", metavar="PATH", help="kubectl to use (default: kubectl on PATH)")
    p.add_argument("--sbatch", default="sbatch", metavar="PATH", help="sbatch to use with --target slurm (default: sbatch on PATH)")
    p.set_defaults(func=submit_main)


def _describe(spec: JobSpec) -> str:
    if spec.kind == "inference":
        return f"inference service {spec.name!r}: {spec.replicas} replica(s), port {spec.serve.port}"
    gpus = f"{spec.gpu_count} x {spec.gpu_resource}" if spec.gpu_resource else "no GPU"
    return (f"training job {spec.name!r}: {spec.nnodes} replica(s) x {spec.procs_per_replica} process(es), "
            f"{gpus} per replica")


def _checked(spec: JobSpec, target: str) -> list[dict]:
    from .validate import validate_manifests

    objs = render(spec, target)
    validate_manifests(objs)
    return objs


def validate_main(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    print(f"{args.spec}: valid {_describe(spec)}")
    if args.spec_only:
        return 0
    targets = [args.target] if args.target else (list(ALL_TARGETS) if spec.kind == "training" else [DEFAULT_TARGET])
    for target in targets:
        if target == SLURM:
            _validate_slurm(spec, args.spec, online=args.target == SLURM)
            continue
        try:
            objs = _checked(spec, target)
        except TargetUnsupported as exc:
            # Reported, not fatal, when all targets are checked; a manifest
            # that fails validation is always fatal.
            if args.target is not None:
                raise
            print(f"  {target}: not available: {exc}")
            continue
        kinds = ", ".join(o["kind"] for o in objs)
        label = "deployment" if spec.kind == "inference" else target
        print(f"  {label}: {kinds}: pass offline validation")
    return 0


def _validate_slurm(spec: JobSpec, path: str, online: bool) -> None:
    """bash -n on the script; online (--target slurm): sbatch --test-only where sbatch and a controller answer."""
    from . import slurm

    script = slurm.render_sbatch(spec, path)
    slurm.check_syntax(script)
    if not online:
        print(f"  {SLURM}: sbatch script: passes bash -n")
        return
    exe = slurm.find_sbatch()
    if exe is None:
        print(f"  {SLURM}: sbatch script: passes bash -n; sbatch --test-only skipped: sbatch is not installed")
        return
    try:
        answer = slurm.sbatch_test_only(script, exe)
    except UsageError as exc:
        print(f"  {SLURM}: sbatch script: passes bash -n; sbatch --test-only skipped: {exc}")
        return
    print(f"  {SLURM}: sbatch script: passes bash -n and sbatch --test-only ({answer})")


def _file_name(obj: dict) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def render_main(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    if args.target == SLURM:
        return _render_slurm(spec, args)
    objs = render(spec, args.target) if args.skip_validation else _checked(spec, args.target)
    if args.out is None:
        sys.stdout.write(to_yaml(objs))
        return 0
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out: cannot create directory {args.out}: {exc.strerror}") from None
    for obj in objs:
        path = os.path.join(args.out, _file_name(obj))
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(to_yaml([obj]))
        print(f"wrote {path}")
    return 0


def _slurm_script(spec: JobSpec, path: str, check: bool = True) -> str:
    from . import slurm

    script = slurm.render_sbatch(spec, path)
    if check:
        slurm.check_syntax(script)
    return script


def _render_slurm(spec: JobSpec, args: argparse.Namespace) -> int:
    script = _slurm_script(spec, args.spec, check=not args.skip_validation)
    if args.out is None:
        sys.stdout.write(script)
        return 0
    path = os.path.join(args.out, f"{spec.name}.sbatch")
    try:
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(script)
    except OSError as exc:
        raise UsageError(f"--out: cannot write {path}: {exc.strerror}") from None
    print(f"wrote {path}")
    return 0


def _submit_slurm(spec: JobSpec, args: argparse.Namespace) -> int:
    """Render, bash -n, sbatch --parsable; print the job id and record the submission."""
    from . import slurm

    script = _slurm_script(spec, args.spec)
    if args.dry_run:
        print(f"# would run: {args.sbatch} --parsable  (script below on its stdin, passes bash -n)")
        sys.stdout.write(script)
        return 0
    exe = slurm.find_sbatch(args.sbatch)
    if exe is None:
        raise UsageError(
            f"--sbatch: sbatch not found ({args.sbatch!r} is not on PATH): run this on a Slurm login node, or write the "
            f"script with `slipstream render {args.spec} --target slurm --out DIR` and submit it yourself"
        )
    job_id = slurm.sbatch_submit(script, exe)
    print(job_id, flush=True)  # first: the job exists whatever happens to its record
    _record(name=spec.name, target=SLURM, engine_id=job_id, run_dir=slurm.run_dir(os.getcwd(), job_id),
            spec_path=spec.source_path or args.spec)
    print(f"submitted {spec.name} as Slurm job {job_id}; output: {slurm.output_path(spec, job_id)}; "
          f"follow it with: slipstream status {spec.name}", file=sys.stderr)
    return 0


def _record(**fields: str | None) -> None:
    """Record a submitted job for ``slipstream status|logs|cancel``; the job is already submitted,
    so a record that cannot be written is a warning (the lifecycle commands take ``--target``)."""
    from .submissions import record_submission, state_dir

    try:
        record_submission(**fields)  # type: ignore[arg-type]
    except OSError as exc:
        print(f"slipstream submit: warning: submitted, but its record could not be written to {state_dir()} "
              f"({exc.strerror}); use --target with status/logs/cancel", file=sys.stderr)


def submit_main(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec)
    if args.target == SLURM:
        return _submit_slurm(spec, args)
    objs = _checked(spec, args.target)
    text = to_yaml(objs)
    cmd = [args.kubectl, "apply", "-f", "-"]
    if args.dry_run:
        print(f"# would run: {' '.join(cmd)}  (manifests below, {len(objs)} object(s), validated offline)")
        sys.stdout.write(text)
        return 0
    exe = shutil.which(args.kubectl)
    if exe is None:
        raise UsageError(
            f"--kubectl: kubectl not found ({args.kubectl!r} is not on PATH): install kubectl, or write the manifests with "
            f"`slipstream render {args.spec} --target {args.target} --out DIR` and apply them yourself"
        )
    try:
        proc = subprocess.run([exe, *cmd[1:]], input=text, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise UsageError("kubectl apply did not answer within 300 s: is the cluster reachable?") from None
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip()
        low = err.lower()
        if "no matches for kind" in low or "ensure crds are installed" in low:
            raise UsageError(
                f"the cluster does not know the {objs[-1]['kind']} kind (its CRD is not installed); install "
                f"it or use --target indexed-job, which needs no CRD. kubectl said: {err}"
            )
        if cluster_unreachable(low):
            raise UsageError(f"no Kubernetes cluster reachable through kubectl (check your kubeconfig/context). kubectl said: {err}")
        raise SubmitFailed(f"kubectl apply failed (exit {proc.returncode}): {err}")
    sys.stdout.write(proc.stdout)
    _record(name=spec.name, target=args.target, engine_id=spec.name, namespace=spec.namespace,
            spec_path=spec.source_path or args.spec)
    ns = f" -n {spec.namespace}" if spec.namespace else ""
    print(f"submitted {spec.name}; follow it with: slipstream status {spec.name} "
          f"(or kubectl get pods{ns} -l {JOB_LABEL}={spec.name})")
    return 0


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def schema_main(args: argparse.Namespace) -> int:
    """``slipstream job schema [--out PATH]``."""
    from .json_schema import schema_text

    text = schema_text()
    if args.out is None:
        sys.stdout.write(text)
        return 0
    try:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as exc:
        raise UsageError(f"--out: cannot write {args.out}: {exc.strerror}") from None
    print(f"wrote {args.out}")
    return 0


# Flags of `slipstream run` that the spec decides; giving them with a spec is an error.
_TOPOLOGY_FLAGS = (
    ("nnodes", "1", "--nnodes", "replicas / elastic"),
    ("nproc_per_node", 1, "--nproc-per-node", "gpu_count / processes_per_replica"),
    ("node_rank", None, "--node-rank", "replicas (every replica is started here)"),
    ("rdzv_endpoint", None, "--rdzv-endpoint", "nothing: a free local port is used"),
    ("module", False, "-m", "command: [python, -m, MODULE]"),
    ("local_addr", None, "--local-addr", "nothing: local replicas publish 127.0.0.1"),
)

# Options only the launcher has: after JOB.yaml they would reach the script
# (argparse passes everything after the positional through), so they are refused there.
_LAUNCHER_ONLY = ("--emulate", "--link", "--nnodes", "--nproc-per-node", "--node-rank", "--rdzv-endpoint",
                  "--rdzv-id", "--max-restarts", "--local-addr", "--heal", "--no-heal", "--spares")


def job_run_from_args(args: argparse.Namespace) -> JobRun:
    """The ``slipstream run`` flags given with a job spec, checked, as a :class:`JobRun`.

    Example::

        args = build_parser().parse_args(["run", "--precision", "bf16", "job.yaml", "--", "--steps", "5"])
        job_run_from_args(args)   # JobRun(spec=..., script_args=("--steps", "5"), worker_env={"SLIPSTREAM_PRECISION": "bf16"})
    """
    spec = load_spec(args.script)
    return job_run(spec, run_flags(args))


def job_run(spec: JobSpec, flags: RunFlags) -> JobRun:
    """``slipstream run``'s typed flags (:func:`~slipstream.launch.cli.run_flags`) over a loaded spec, as a
    :class:`JobRun`; the flags the spec decides, or that would change nothing, are refused (one line each).

    Example::

        job_run(load_spec("job.yaml"), run_flags(build_parser().parse_args(["run", "--no-heal", "job.yaml"])))
    """
    path, f = flags.script, flags.launcher
    clash = [key for key in flags.config_launcher if key in {dest for dest, *_ in _TOPOLOGY_FLAGS}]
    if clash:
        raise UsageError(f"{flags.config_path}: {', '.join(clash)} cannot be combined with a job spec ({path}); "
                         "the spec sets the topology (replicas, gpu_count, processes_per_replica, command)")
    for dest, default, flag, where in _TOPOLOGY_FLAGS:
        if getattr(f, dest) != default:
            raise UsageError(f"{flag} cannot be combined with a job spec ({path}); set {where} in the spec instead")
    handled = {dest for dest, *_ in _TOPOLOGY_FLAGS} | {"max_restarts", "rdzv_id", "rdzv_conf"}
    for dest, (flag, default) in torchrun_option_defaults().items():
        if dest not in handled and getattr(f, dest, default) != default:
            raise UsageError(
                f"{flag} has no effect with a job spec ({path}): the job runner starts and configures "
                "each replica's agent itself; run the script directly with slipstream run to use it"
            )
    extra = list(flags.script_args)
    _refuse_misplaced_flags(extra, path)
    env = worker_env(flags)
    spec = _with_heal_flags(spec, flags)
    ours, spec_values = flags.training, config_values(spec)
    for name in replaced(spec_values, ours):  # the precedence rule, said when it bites (docs/launcher.md)
        print(f"slipstream run: {name} {env_text(ours[name])} (its flags or --config) overrides {path}'s "
              f"{name} {env_text(spec_values[name])}", file=sys.stderr, flush=True)
    return JobRun(
        spec=spec, script_args=tuple(extra), worker_env=env,
        max_restarts=f.max_restarts or None,  # --max-restarts 0 (its default) leaves the spec's budget
        rdzv_id=f.rdzv_id, rdzv_conf=parse_rdzv_conf(f.rdzv_conf or ""), emulate=f.emulate, link=f.link,
    )


def _with_heal_flags(spec: JobSpec, flags: RunFlags) -> JobSpec:
    """``--heal``/``--no-heal`` and ``--spares`` (flags or run config) over the spec's ``restarts.heal``
    and ``restarts.spares``, as every launcher setting goes over the spec's value."""
    heal, spares = heal_settings(flags)  # --no-heal with --spares is refused there
    restarts = spec.restarts
    if heal is not None:
        restarts = dataclasses.replace(restarts, heal=heal)
    if spares is not None:
        if not restarts.heal:
            raise UsageError(f"--spares {spares} keeps warm replacements for healing in place, which "
                             f"{flags.script}'s restarts.heal: false turns off: give --heal too, or no --spares")
        restarts = dataclasses.replace(restarts, spares=spares)
    return spec if restarts == spec.restarts else dataclasses.replace(spec, restarts=restarts)


def _refuse_misplaced_flags(extra: list[str], path: str) -> None:
    for token in extra:
        if token == "--":
            return
        if token.split("=", 1)[0] in _LAUNCHER_ONLY:
            raise UsageError(
                f"{token.split('=', 1)[0]} must come before the job spec: slipstream run [FLAGS] {path} [-- SCRIPT ARGS]"
            )


def run_main(args: argparse.Namespace) -> int:
    """``slipstream run [FLAGS] JOB.yaml [-- ARGS]``."""
    return run_job(job_run_from_args(args))


__all__ = ["register", "run_main", "job_run_from_args", "job_run", "schema_main", "validate_main", "render_main", "submit_main", "SubmitFailed"]
