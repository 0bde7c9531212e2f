"""``slipstream run JOB.yaml``: the job spec on this machine.

How replicas map to processes here (chosen so a local run exercises the same
path as a cluster run):

* Each replica is its own elastic agent (one ``slipstream run`` subprocess per
  replica) with ``--nnodes R[:MAX] --node-rank i --rdzv-endpoint 127.0.0.1:PORT
  --rdzv-id ID``, exactly the flags a pod gets, so GROUP_RANK, LOCAL_WORLD_SIZE
  and the c10d rendezvous behave as on R machines.
* Processes per replica = processes_per_replica, else gpu_count, else 1. With
  enough GPUs each replica sees its own (CUDA_VISIBLE_DEVICES); with none the
  processes run on CPU (gloo); with too few, NCCL is refused (one GPU per
  process) and gloo shares them on purpose (``--backend gloo --device cuda``,
  or SLIPSTREAM_BACKEND/SLIPSTREAM_DEVICE in the spec's ``env``).
* ``--emulate`` hands the same shape to ``slipstream.launch.emulate_job.run_emulated``
  (one network namespace per replica, shaped links).
* Training options reach the workers as SLIPSTREAM_* variables; ``--sync``,
  ``--precision`` and the other training flags of ``slipstream run`` override
  the spec's values.

If one replica fails, the others are stopped (SIGTERM, then SIGKILL after a
grace period) and the run exits with the failing replica's code (1 for a
training failure, 143 for preemption), or 2 if any replica exited 2 (a
worker's usage or configuration error, which is not restarted).

Example::

    slipstream run examples/jobs/local-2x1.yaml
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Mapping

from ..errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_TRAINING_FAILED, EXIT_USAGE, ConfigError, UsageError
from ..launch.proc import stop_processes
from ..log import CONSOLE
from ..process import safe_signals
from .commands import launcher_flags, prewarm_command, resolved_entry_argv, resolved_env
from .spec import JobSpec
from .variables import expand

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""How long the other replicas get to exit after one failed, before SIGTERM."""
KILL_GRACE_S = 5.0
"""How long stopped replicas get between SIGTERM and SIGKILL."""


@dataclass(frozen=True)
class JobRun:
    """``slipstream run [FLAGS] JOB.yaml [-- ARGS]`` as a typed request (built by job/cli.py).

    Example::

        run_job(JobRun(load_spec("examples/jobs/local-2x1.yaml"), script_args=("--out", "/tmp/sum.txt")))
    """

    spec: JobSpec
    script_args: tuple[str, ...] = ()
    """Appended to the spec's command (what followed ``--``)."""
    worker_env: Mapping[str, str] = field(default_factory=dict)
    """SLIPSTREAM_* variables from the run's flags; they win over the spec's."""
    max_restarts: int | None = None
    """None: the spec's ``restarts.max_restarts``."""
    rdzv_id: str | None = None
    """None: the job name plus a random suffix."""
    rdzv_conf: Mapping[str, str] = field(default_factory=dict)
    """Extra c10d rendezvous settings (``--rdzv-conf``)."""
    emulate: str | None = None
    """None: run locally; ``"spec"`` or ``"NxP"`` (which must match the spec): an emulated cluster."""
    link: str = "unshaped"
    """With ``emulate``: each emulated node's link, ``RATE[,RTT][,LOSS]`` (see docs/cluster.md)."""


def run_job(request: JobRun) -> int:
    """Run a job spec locally (or on an emulated cluster); returns the exit code.

    Example::

        run_job(JobRun(load_spec("examples/jobs/local-2x1.yaml"), emulate="2x1", link="1gbit"))
    """
    spec = request.spec
    env = resolved_env(spec)  # $(VAR) references expanded, as the kubelet would
    env.update(request.worker_env)
    extra = list(request.script_args)
    if spec.kind == "inference":
        return _run_inference(spec, env, extra)
    _check_entrypoint(spec, spec.source_path or spec.name, env)
    max_restarts = spec.restarts.max_restarts if request.max_restarts is None else request.max_restarts
    if request.emulate:
        return _run_emulated(spec, request, env, extra, max_restarts)
    return run_local(spec, env=env, extra_args=extra, max_restarts=max_restarts,
                     rdzv_id=request.rdzv_id, rdzv_conf=request.rdzv_conf)


def _check_entrypoint(spec: JobSpec, path: str, env: Mapping[str, str]) -> None:
    ep = spec.entrypoint
    ep = dataclasses.replace(ep, target=expand(ep.target, env))
    if ep.module:
        import importlib.util

        try:
            found = importlib.util.find_spec(ep.target) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"command: module {ep.target!r} is not importable here (from {path})")
    elif not os.path.isfile(ep.target):
        raise UsageError(
            f"command: training script not found: {ep.target} (relative to the current directory "
            f"{os.getcwd()}, as in the container's working directory)"
        )


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A TCP port free on ``host`` right now (the rendezvous store binds it next), with the
    ``count - 1`` ports after it free too: the replicas' launcher hosts the healing store on the
    rendezvous port + 1 (slipstream.launch.api), and a taken one there would fail the launch."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if all(_bindable(host, port + i) for i in range(1, count)):
            return port
    raise UsageError(f"no {count} consecutive free TCP ports found on {host} for the rendezvous")


def _bindable(host: str, port: int) -> bool:
    if port > 65535:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def plan_gpus(spec: JobSpec, have: int, visible: str | None = None, backend: str | None = None,
              device: str | None = None) -> tuple[list[str | None], str | None]:
    """CUDA_VISIBLE_DEVICES per replica (None: leave as is) and a note for the user.

    ``have``: GPUs this machine shows (``visible``: its CUDA_VISIBLE_DEVICES);
    ``backend``/``device``: what the workers were asked to use (SLIPSTREAM_BACKEND
    / SLIPSTREAM_DEVICE, from ``--backend``/``--device`` or the spec's ``env``).
    Under NCCL (the default with GPUs) every process needs its own GPU: a plan
    where processes would share one is refused with the numbers (UsageError,
    exit 2), since NCCL would only fail later, obscurely. gloo shares on purpose.

    Example::

        spec = parse_spec({"name": "a", "image": "i", "command": ["python", "t.py"], "replicas": 2, "gpu_count": 1})
        plan_gpus(spec, have=2)                                    # (["0", "1"], None)
        plan_gpus(spec, have=1)                                    # UsageError: 1 GPU(s) here for 2 requested ...
        plan_gpus(spec, have=1, backend="gloo", device="cuda")     # ([None, None], "... share them ...")
    """
    procs = spec.procs_per_replica
    wants_gpu = backend == "nccl" or device == "cuda"
    if spec.gpu_count == 0:
        if wants_gpu:
            raise UsageError(
                f"gpu_count is 0 but the workers are asked for GPUs (backend {backend or 'default'}, device "
                f"{device or 'default'}); set gpu_count in the spec, or drop --backend nccl / --device cuda"
            )
        if have > 0:
            # As in a pod that requested no GPU: otherwise every replica's rank 0
            # would default to NCCL on GPU 0, and NCCL refuses a shared GPU.
            return [""] * spec.replicas, f"gpu_count 0: the {have} GPU(s) here are hidden; running on CPU with gloo"
        return [None] * spec.replicas, None
    if have == 0:
        return [None] * spec.replicas, (
            f"no GPU here: running {spec.replicas} replica(s) x {procs} CPU process(es) with gloo"
        )
    shown = visible if visible is not None else "unset"
    sharing_ok = backend == "gloo"
    advice = ("or run with --backend gloo --device cuda (or SLIPSTREAM_BACKEND: gloo and SLIPSTREAM_DEVICE: cuda "
              "in the spec's env) to share GPUs on purpose")
    if procs > spec.gpu_count and not sharing_ok:
        raise UsageError(
            f"processes_per_replica {procs} > gpu_count {spec.gpu_count}: NCCL needs one GPU per process; "
            f"set processes_per_replica <= gpu_count, {advice}"
        )
    need = spec.replicas * spec.gpu_count
    if have < need:
        if not sharing_ok:
            raise UsageError(
                f"{have} GPU(s) here (CUDA_VISIBLE_DEVICES={shown}) for {need} requested ({spec.replicas} replica(s) "
                f"x gpu_count {spec.gpu_count}): NCCL needs one GPU per process; lower replicas or gpu_count, {advice}"
            )
        how = "replicas share them (gloo)" if device == "cuda" else "gloo runs on the CPU (add --device cuda to share them)"
        return [None] * spec.replicas, (
            f"{have} GPU(s) here for {need} requested ({spec.replicas} x gpu_count {spec.gpu_count}): {how}"
        )
    ids = visible.split(",") if visible else [str(i) for i in range(have)]
    return [",".join(ids[i * spec.gpu_count:(i + 1) * spec.gpu_count]) for i in range(spec.replicas)], None


def _gpu_plan(spec: JobSpec, env: dict[str, str]) -> tuple[list[str | None], str | None]:
    """:func:`plan_gpus` for this machine and the workers' environment ``env``."""
    import torch

    from ..process.runtime import requested_placement

    try:
        backend, device = requested_placement(env)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return plan_gpus(spec, have, env.get("CUDA_VISIBLE_DEVICES"), backend, device)


def run_local(spec: JobSpec, env: dict[str, str] | None = None, extra_args: list[str] | None = None,
              max_restarts: int | None = None, rdzv_id: str | None = None,
              rdzv_conf: Mapping[str, str] | None = None) -> int:
    """Start every replica as an elastic agent on this machine and wait for all of them.

    Example::

        run_local(load_spec("examples/jobs/local-2x1.yaml"))   # 0 on success
    """
    env = resolved_env(spec) if env is None else env
    extra_args = extra_args or []
    rdzv_id = rdzv_id or f"{spec.name}-{uuid.uuid4().hex[:8]}"
    if max_restarts is not None and max_restarts != spec.restarts.max_restarts:
        spec = dataclasses.replace(spec, restarts=dataclasses.replace(spec.restarts, max_restarts=max_restarts))
    base_env = dict(os.environ)
    base_env.update(env)
    devices, note = _gpu_plan(spec, base_env)
    if note:
        log.info("slipstream run: %s", note, extra=CONSOLE)
    code = prewarm_local(spec, base_env, variables=env)
    if code != EXIT_OK:
        return code
    endpoint = f"127.0.0.1:{free_port(count=2)}"  # + 1: the healing store (on by default)
    procs: list[subprocess.Popen] = []
    try:
        for i in range(spec.replicas):
            argv = [sys.executable, "-m", "slipstream", "run",
                    *launcher_flags(spec, spec.nnodes, endpoint, str(i), rdzv_id, local_addr="127.0.0.1"),
                    *(["--rdzv-conf", ",".join(f"{k}={v}" for k, v in rdzv_conf.items())] if rdzv_conf else []),
                    *resolved_entry_argv(spec, env, extra_args)]
            child_env = dict(base_env)
            if devices[i] is not None:
                child_env["CUDA_VISIBLE_DEVICES"] = devices[i]
            procs.append(subprocess.Popen(argv, env=child_env))
        # Ctrl-C raises outside stdlib code only: inside a replica's Popen.poll it would
        # leave that Popen's lock held, and the replica's exit unseen.
        with safe_signals.installed(signal.SIGINT, lambda signum: KeyboardInterrupt()):
            return _wait_all(procs)
    except KeyboardInterrupt:
        stop_processes(procs, grace_s=KILL_GRACE_S)
        log.info("slipstream run: interrupted", extra=CONSOLE)
        return EXIT_INTERRUPTED
    finally:
        stop_processes(procs, grace_s=KILL_GRACE_S)


def prewarm_local(spec: JobSpec, env: dict[str, str], variables: Mapping[str, str] | None = None) -> int:
    """With ``data.prewarm`` and a ``cache_dir``: fill the cache once, before any replica starts
    (the same ``slipstream data prewarm`` the pods run as an init container). Returns its exit code.
    ``variables``: what the command's ``$(VAR)`` references expand to (default: the spec's resolved env)."""
    cmd = prewarm_command(spec)
    if cmd is None:
        return EXIT_OK
    variables = resolved_env(spec) if variables is None else variables
    cmd = [expand(word, variables) for word in cmd]
    argv = [sys.executable, "-m", "slipstream", *cmd[1:]]
    log.info("slipstream run: prewarming %s from %s", spec.data.cache_dir, spec.data.source, extra=CONSOLE)
    code = subprocess.run(argv, env=env).returncode
    if code != EXIT_OK:
        log.error("slipstream run: prewarm failed with exit code %s; not starting the replicas", code)
    return code


def _wait_all(procs: list[subprocess.Popen]) -> int:
    first_failure: tuple[int, int] | None = None  # (replica, code)
    failed_at = 0.0
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        for i, c in enumerate(codes):
            if c not in (None, 0) and first_failure is None:
                first_failure, failed_at = (i, c), time.monotonic()
                log.error("slipstream run: replica %d exited with code %s; stopping the others", i, c)
        if first_failure is not None and time.monotonic() - failed_at > STOP_GRACE_S:
            stop_processes(procs, grace_s=KILL_GRACE_S)
        time.sleep(0.1)
    if first_failure is None:
        bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
        if not bad:
            return EXIT_OK
        first_failure = bad[0]
    if any(p.returncode == EXIT_USAGE for p in procs):
        # A replica's usage error (a worker's ConfigError: exit 2, not restarted) is the cause,
        # even when a peer replica noticed its departure first and exited 1.
        return EXIT_USAGE
    code = first_failure[1]
    if code < 0:  # killed by a signal
        return 128 - code if -code == signal.SIGTERM else EXIT_TRAINING_FAILED
    return code


def _run_inference(spec: JobSpec, env: dict[str, str], extra: list[str]) -> int:
    """A serving spec runs its command once, in the foreground, with the spec's env."""
    child_env = dict(os.environ)
    child_env.update(env)
    cmd = [expand(word, env) for word in spec.full_command] + extra
    log.info("slipstream run: serving %s on port %s: %s", spec.name, spec.serve.port, " ".join(cmd), extra=CONSOLE)
    try:
        proc = subprocess.Popen(cmd, env=child_env)
    except FileNotFoundError:
        raise UsageError(f"command: {cmd[0]!r} not found on PATH") from None
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        return EXIT_INTERRUPTED


def parse_emulate(value: str | bool | None, spec: JobSpec) -> None:
    """``--emulate`` with a spec: True/"spec" use the spec's shape; NxP must match it."""
    if value is True or value in ("", "spec", "auto"):
        return
    text = str(value).lower()
    try:
        nodes, procs = (int(x) for x in text.split("x"))
    except ValueError:
        raise UsageError(f"--emulate must be NODESxPROCS (e.g. 2x1) or 'spec', got {value!r}") from None
    if (nodes, procs) != (spec.replicas, spec.procs_per_replica):
        raise UsageError(
            f"--emulate {value} does not match the job spec ({spec.replicas} replicas x "
            f"{spec.procs_per_replica} processes); use --emulate {spec.replicas}x{spec.procs_per_replica}"
        )


def _run_emulated(spec: JobSpec, request: JobRun, env: dict[str, str], extra: list[str], max_restarts: int) -> int:
    parse_emulate(request.emulate, spec)
    try:
        from ..launch.emulate_job import run_emulated
    except ImportError as exc:
        raise UsageError(f"--emulate is not available in this installation (slipstream.launch.emulate: {exc})") from None
    from ..launch.api import LaunchOptions

    ep_argv = resolved_entry_argv(spec, env, extra)
    module = ep_argv[0] == "-m"
    entry = ep_argv[1] if module else ep_argv[0]
    rest = ep_argv[2:] if module else ep_argv[1:]
    base = LaunchOptions(
        entrypoint=entry, args=rest, nproc_per_node=spec.procs_per_replica,
        min_nodes=spec.min_replicas, max_nodes=spec.max_replicas,
        rdzv_id=request.rdzv_id or f"{spec.name}-{uuid.uuid4().hex[:8]}", max_restarts=max_restarts,
        module=module, worker_env=env, rdzv_conf=dict(request.rdzv_conf),
        # The spec's departures from the launcher's default, as launcher_flags renders them.
        heal=None if spec.restarts.heal else False,
        spares=spec.restarts.spares if spec.restarts.heal and spec.restarts.spares != 1 else None,
    )
    return run_emulated(spec.replicas, spec.procs_per_replica, request.link or "unshaped", base)


__all__ = ["JobRun", "run_job", "run_local", "free_port", "parse_emulate", "plan_gpus"]
