"""The Slurm target: an sbatch script from a :class:`~slipstream.job.spec.JobSpec`.

One ``slipstream run`` agent per node (``--ntasks-per-node=1``), started by one
``srun``; the agents meet at a c10d rendezvous on the allocation's first node
(the one running the batch script, ``SLURM_NODEID`` 0), on a port derived from
the job id so that jobs sharing a node do not collide. Each agent publishes its
node's ``NodeAddr`` (``--local-addr``), as a pod publishes its IP.

Preemption: SIGTERM reaches the agents (``scancel --signal=TERM``, the time
limit through ``--signal=TERM@signal_grace_s``, or a preempting job), the
workers write the emergency checkpoint and the agents exit 143
(``EXIT_PREEMPTED``); ``srun`` returns it and the batch script requeues the job
(``scontrol requeue``), which resumes from the checkpoint. A signal to the batch
shell alone (``scancel -b``) is passed on to ``srun``, which forwards it to the agents.

The spec's words (command, args) and env values reach the program as on Kubernetes
(:mod:`slipstream.job.variables`): each is one single-quoted shell word but for its
``$(VAR)`` references to the spec's own variables, which become ``"${VAR}"``; no other
byte of the spec is read by a shell. Env names bash or srun own are refused (:data:`SHELL_NAMES`).

The spec's ``image`` is not used: the job runs in the nodes' own software
environment (``slipstream`` and the script must be installed there). Kubernetes-only
keys (``namespace``, ``queue``, ``priority_class``, ``network``, ``shm_size``,
``checkpoint.volume_claim``) are ignored.

Example::

    from slipstream.job import load_spec
    from slipstream.job.slurm import render_sbatch
    print(render_sbatch(load_spec("examples/jobs/local-2x1.yaml")))   # #!/bin/bash, #SBATCH --nodes=2, ...
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import subprocess
from decimal import Decimal

from ..errors import EXIT_PREEMPTED, ConfigError, SlipstreamError, UsageError
from .commands import RANK_PREFIX, RANK_PREFIX_ENV, TEE_FLAGS, entry_argv, launcher_flags, prewarm_command
from .quantity import parse_quantity
from .render import TargetUnsupported
from .spec import RDZV_PORT, JobSpec
from .variables import shell_word

TARGET = "slurm"
PORT_SPAN = 20000
"""The rendezvous port is ``RDZV_PORT + (7 * SLURM_JOB_ID + SLURM_RESTART_COUNT) % PORT_SPAN`` (29400..49399)."""
NODE_ADDR = "$(scontrol show node \"$SLURMD_NODENAME\" -o | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')"
"""Shell expression: the NodeAddr of the node a task runs on."""


RUN_DIR = "$SLURM_SUBMIT_DIR/runs/slurm-$SLURM_JOB_ID"
"""The run directory (metrics, timeline) under the submit directory: one per job, for all its attempts."""


def run_dir(submit_dir: str, job_id: str) -> str:
    """Where a submitted job's run directory is: :data:`RUN_DIR` under the directory sbatch ran in."""
    return RUN_DIR.replace("$SLURM_SUBMIT_DIR", submit_dir).replace("$SLURM_JOB_ID", job_id)


def output_pattern(spec: JobSpec) -> str:
    """The batch script's ``--output``: ``slipstream-<name>-%j.out`` in the submission directory."""
    return f"slipstream-{spec.name}-%j.out"


def output_path(spec: JobSpec, job_id: str) -> str:
    """The output file of job ``job_id`` (relative to the submission directory)."""
    return output_pattern(spec).replace("%j", job_id)


def cpus_per_task(spec: JobSpec) -> int:
    """CPUs for each node's one task (agent + workers): the spec's ``cpu``, else one per worker."""
    if spec.cpu:
        return max(1, math.ceil(parse_quantity(spec.cpu)))
    return max(1, spec.procs_per_replica)


def sbatch_options(spec: JobSpec) -> list[str]:
    """The ``#SBATCH`` options, in the order written (``--nodes=2``, ``--ntasks-per-node=1``, ...)."""
    nodes = str(spec.replicas) if spec.min_replicas == spec.max_replicas else f"{spec.min_replicas}-{spec.max_replicas}"
    opts = [f"--job-name={spec.name}", f"--nodes={nodes}", "--ntasks-per-node=1"]
    # The agent's task holds the node's workers: without `cpu`, one CPU per worker (Slurm's default
    # would be one CPU for the whole task, and a cgroup would confine every worker to it).
    opts.append(f"--cpus-per-task={cpus_per_task(spec)}")
    if spec.memory:
        opts.append(f"--mem={max(1, math.ceil(parse_quantity(spec.memory) / Decimal(2**20)))}M")
    if spec.gpu_count:
        if spec.gpu_slice.mig:  # Slurm's MIG gres type is the profile without "mig-" (gres.conf AutoDetect=nvml)
            opts.append(f"--gres=gpu:{spec.gpu_slice.mig.removeprefix('mig-')}:{spec.gpu_count}")
        elif spec.gpu_slice.time_sliced:  # GRES sharding (Slurm >= 22.05)
            opts.append(f"--gres=shard:{spec.gpu_count}")
        else:
            opts.append(f"--gpus-per-node={spec.gpu_count}")
    s = spec.slurm
    opts += [f"--{key}={value}" for key, value in
             (("time", s.time), ("partition", s.partition), ("account", s.account), ("qos", s.qos)) if value]
    opts.append("--requeue" if s.requeue else "--no-requeue")
    # SIGTERM to the job steps (the agents) before the time limit: the emergency checkpoint's time.
    opts.append(f"--signal=TERM@{s.signal_grace_s}")
    # A requeued job appends to the same file: one log per job id, every attempt in it.
    opts += [f"--output={output_pattern(spec)}", "--open-mode=append"]
    return opts


SHELL_NAMES = frozenset({"UID", "EUID", "PPID", "SHELLOPTS", "BASHOPTS", "BASH_VERSINFO", "BASH_ENV", "IFS",
                         "RDZV_NODE", "RDZV_HOST", "RDZV_PORT", "JOB_ENDING", "SRUN_PID", "rc"})
"""Env names the sbatch script cannot pass on unchanged: bash holds them read-only or reads them
itself (``BASH_ENV`` would run a file in the ``bash -c`` of the launch line), or the script sets them."""
SLURM_PREFIXES = ("SLURM_", "SRUN_", "SBATCH_")
"""Env prefixes srun and sbatch read as their own options (``SLURM_EXPORT_ENV``, ``SRUN_CPUS_PER_TASK``...)."""


def _own_words(argv: list[str]) -> str:
    """The renderer's own words as shell words: those starting with ``$`` are shell expressions
    (``$SLURM_NODEID``, :data:`NODE_ADDR`) and stay expandable, in double quotes. Never the spec's text."""
    return " ".join(f'"{a}"' if a.startswith("$") else shlex.quote(a) for a in argv)


def _spec_words(argv: list[str], defined: set[str]) -> str:
    """Words from the spec: each one single-quoted but for its ``$(VAR)`` references to ``defined``
    variables, which become ``"${VAR}"`` (Kubernetes' rule, :func:`~slipstream.job.variables.shell_word`)."""
    return " ".join(shell_word(a, defined) for a in argv)


def _check_env_names(spec: JobSpec) -> None:
    for name in spec.worker_env():
        if name in SHELL_NAMES or name.startswith(SLURM_PREFIXES):
            raise TargetUnsupported(
                f"env.{name}: the slurm target cannot pass it to the program unchanged (bash or the batch "
                f"script sets or reads it; names starting with {', '.join(SLURM_PREFIXES)} are srun's and "
                f"sbatch's options), got {name}")


def render_sbatch(spec: JobSpec, source: str | None = None) -> str:
    """The sbatch script of a training spec (``source``: the spec's path, for the header comment)."""
    if spec.kind != "training":
        raise TargetUnsupported(f"kind: the slurm target runs training jobs only, got {spec.kind!r}")
    flags = launcher_flags(spec, spec.nnodes, "$RDZV_HOST:$RDZV_PORT", "$SLURM_NODEID", "$SLURM_JOB_ID",
                           local_addr=NODE_ADDR)
    # --tee 3 with the prefix template below: every worker line reads "[rankR]:...", which
    # `slipstream logs JOB --rank R` filters on; the run directory is the job's, kept across requeues.
    flags += [*TEE_FLAGS, "--run-dir", RUN_DIR]
    _check_env_names(spec)
    env = spec.worker_env()
    agent = f"{_own_words(['slipstream', 'run', *flags])} {_spec_words(entry_argv(spec), set(env))}"
    lines = ["#!/bin/bash", f"# Rendered by `slipstream render --target slurm`{f' from {source}' if source else ''}: "
             f"{spec.replicas} node(s), one `slipstream run` agent per node, {spec.procs_per_replica} worker(s) each.",
             f"# image {spec.image} is not used on Slurm: the nodes' own environment runs the job."]
    lines += [f"#SBATCH {o}" for o in sbatch_options(spec)]
    lines += ["", "set -u",
              "# srun does not inherit sbatch's --cpus-per-task (Slurm 22.05 and some later releases): pass it on.",
              'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"']
    # The spec's environment, each value's $(VAR) references expanded from the entries before it.
    lines += [f"export {k}={_spec_words([v], set(list(env)[:i]))}" for i, (k, v) in enumerate(env.items())]
    lines += [f"export {RANK_PREFIX_ENV}={shlex.quote(RANK_PREFIX)}"]
    lines += [
        "",
        "# The rendezvous: the allocation's first node (it runs this script, SLURM_NODEID 0).",
        'RDZV_NODE="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "RDZV_HOST=\"$(scontrol show node \"$RDZV_NODE\" -o | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')\"",
        "# A port per job and attempt: jobs may share a node, and a requeued attempt must not wait for",
        "# the previous attempt's port to be released.",
        f"RDZV_PORT=$(({RDZV_PORT} + (SLURM_JOB_ID * 7 + ${{SLURM_RESTART_COUNT:-0}}) % {PORT_SPAN}))",
        'export RDZV_HOST RDZV_PORT',
        'echo "slipstream: job $SLURM_JOB_ID attempt $((${SLURM_RESTART_COUNT:-0} + 1)) on $SLURM_JOB_NODELIST, '
        'rendezvous $RDZV_HOST:$RDZV_PORT"',
    ]
    prewarm = prewarm_command(spec)
    if prewarm is not None:
        lines += ["", "# Fill each node's data cache before training.",
                  f"srun --ntasks-per-node=1 {_spec_words(prewarm + ['--no-progress'], set(env))} || exit $?"]
    lines += [
        "",
        "# srun in the background, so a SIGTERM to this shell runs the trap at once (a foreground",
        "# command would defer it); srun forwards the signal to the agents. A SIGTERM to this shell",
        "# means Slurm ends the whole job (scancel, or a preemption Slurm requeues itself): no requeue",
        "# from here. SIGTERM to the steps only (scancel --signal=TERM, --signal=TERM@N before the time",
        "# limit) leaves this shell running, and the agents' exit 143 requeues the job below.",
        "JOB_ENDING=0",
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=0 bash -c {shlex.quote('exec ' + agent)} &",
        "SRUN_PID=$!",
        "trap 'JOB_ENDING=1; kill -TERM \"$SRUN_PID\" 2>/dev/null' TERM",
        'wait "$SRUN_PID"; rc=$?',
        'while kill -0 "$SRUN_PID" 2>/dev/null; do wait "$SRUN_PID"; rc=$?; done',
    ]
    if spec.slurm.requeue:
        lines += [
            f"if [ \"$rc\" -eq {EXIT_PREEMPTED} ] && [ \"$JOB_ENDING\" -eq 0 ]; then",
            "    # Preempted: the emergency checkpoint is written; the requeued job resumes from it.",
            '    echo "slipstream: job $SLURM_JOB_ID preempted (exit 143): requeueing it" >&2',
            '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
            "fi",
        ]
    lines += ['exit "$rc"', ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- checks and submission

SBATCH_TIMEOUT_S = 60.0
_UNREACHABLE = ("unable to contact slurm controller", "connect failure", "connection refused",
                "could not establish a configuration source", "failed to fetch config",
                "unable to establish controller", "unable to process configuration file")


class SbatchRefused(SlipstreamError):
    """sbatch reached the controller and the controller refused the script."""

    exit_code = 1


def check_syntax(script: str) -> None:
    """``bash -n`` on the script; raises ConfigError with bash's message."""
    proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise ConfigError(f"the rendered sbatch script is not valid shell: {proc.stderr.strip()}")


def find_sbatch(sbatch: str = "sbatch") -> str | None:
    """The sbatch executable, or None when it is not installed."""
    return shutil.which(sbatch)


def _sbatch(exe: str, options: list[str], script: str) -> subprocess.CompletedProcess:
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.exists(conf):  # sbatch would retry for 60 s before saying so
        raise UsageError(f"no Slurm configuration: SLURM_CONF={conf} does not exist")
    try:
        proc = subprocess.run([exe, *options], input=script, capture_output=True, text=True,
                              timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UsageError(f"sbatch did not answer within {SBATCH_TIMEOUT_S:.0f} s: is the Slurm controller "
                         "reachable?") from None
    err = (proc.stderr or proc.stdout).strip()
    if proc.returncode != 0 and any(h in err.lower() for h in _UNREACHABLE):
        raise UsageError(f"no Slurm controller reachable (check SLURM_CONF and that slurmctld runs); "
                         f"sbatch said: {err.splitlines()[-1] if err else ''}")
    if proc.returncode != 0:
        raise SbatchRefused(f"sbatch refused the script (exit {proc.returncode}): {err}")
    return proc


def sbatch_test_only(script: str, exe: str) -> str:
    """``sbatch --test-only``: the controller's answer ("Job ... to start at ..."); raises
    UsageError when no controller answers and SbatchRefused when it refuses the script."""
    proc = _sbatch(exe, ["--test-only"], script)
    return ((proc.stderr or "") + (proc.stdout or "")).strip().splitlines()[-1]


def sbatch_submit(script: str, exe: str) -> str:
    """``sbatch --parsable``: the new job's id (the script's paths are relative to the current directory)."""
    proc = _sbatch(exe, ["--parsable"], script)
    return proc.stdout.strip().split(";")[0]


__all__ = ["TARGET", "PORT_SPAN", "render_sbatch", "sbatch_options", "output_pattern", "output_path",
           "check_syntax", "find_sbatch", "sbatch_test_only", "sbatch_submit", "SbatchRefused", "SBATCH_TIMEOUT_S"]
