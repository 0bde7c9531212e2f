"""The command lines a job runs: ``slipstream run`` flags per replica, the entry point, the
container command, and the data prewarm; shared by the renderer (pods) and the local runner.

Example::

    spec = load_spec("examples/jobs/local-2x1.yaml")
    launcher_command(spec, spec.nnodes, "job-0.job:29400", "0", spec.name)
    # ['slipstream', 'run', '--nnodes', '2', '--nproc-per-node', '1', '--node-rank', '0', ...]
"""

from __future__ import annotations

from decimal import Decimal

from .quantity import parse_quantity
from .spec import JobSpec
from .variables import expand, expand_env

POD_IP_ENV = "SLIPSTREAM_POD_IP"
RANK_PREFIX_ENV = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
RANK_PREFIX = "[rank${rank}]:"
"""With ``slipstream run --tee 3`` (:data:`TEE_FLAGS`), every worker line reads ``[rankR]:...``,
which ``slipstream logs JOB --rank R`` filters on (torch elastic expands ``${rank}``)."""
TEE_FLAGS = ["--tee", "3"]
CACHE_FILL = Decimal("0.9")
"""Share of data.cache_size the prewarmed cache may fill."""


def launcher_flags(spec: JobSpec, nnodes: str, endpoint: str, node_rank: str | None, rdzv_id: str,
                   local_addr: str | None = None) -> list[str]:
    """The ``slipstream run`` flags for one replica (everything before the script)."""
    flags = ["--nnodes", nnodes, "--nproc-per-node", str(spec.procs_per_replica)]
    if node_rank is not None:
        flags += ["--node-rank", node_rank]
    flags += ["--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, "--max-restarts", str(spec.restarts.max_restarts)]
    if local_addr is not None:
        flags += ["--local-addr", local_addr]
    # Healing in place is the launcher's default wherever it applies: only a spec that
    # departs from it says so, and every target (pods, sbatch, local replicas) runs these flags.
    if not spec.restarts.heal:
        flags.append("--no-heal")
    elif spec.restarts.spares != 1:
        flags += ["--spares", str(spec.restarts.spares)]
    return flags


def entry_argv(spec: JobSpec, extra_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """What follows the flags: ``train.py ARGS`` or ``-m pkg.train ARGS``.

    With a GPU memory fraction the user's code runs under ``-m slipstream.job.worker``,
    which applies the cap before the user's code starts.
    """
    argv = spec.entrypoint.run_argv() + list(extra_args)
    if spec.gpu_slice.memory_fraction is not None:
        return ["-m", "slipstream.job.worker", *argv]
    return argv


def resolved_env(spec: JobSpec) -> dict[str, str]:
    """The workers' environment as the program sees it: ``spec.worker_env()`` with each value's
    ``$(VAR)`` references expanded from the entries before it (Kubernetes' rule, :mod:`.variables`).
    Targets that start processes themselves (the local runner) use this; the manifests carry the
    unexpanded values for the kubelet, the sbatch script expands them in the shell."""
    return expand_env(spec.worker_env().items())


def resolved_entry_argv(spec: JobSpec, env: dict[str, str], extra_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """:func:`entry_argv` with the spec's ``$(VAR)`` references expanded from ``env`` (the
    resolved environment); ``extra_args`` (from the command line, not the spec) stay as given."""
    return [expand(word, env) for word in entry_argv(spec)] + list(extra_args)


def launcher_command(
    spec: JobSpec, nnodes: str, endpoint: str, node_rank: str | None, rdzv_id: str
) -> list[str]:
    """The container command: ``slipstream run`` with the rendezvous flags, then the script.

    Each agent publishes its pod IP (``--local-addr``, from the downward API) rather
    than its host name, so peers need no DNS record for it (host network included).
    Worker lines are tagged with their rank (``--tee 3``, with :data:`RANK_PREFIX` in the
    pod's environment), so ``slipstream logs JOB --rank R`` works on pods.
    """
    flags = launcher_flags(spec, nnodes, endpoint, node_rank, rdzv_id, local_addr=f"$({POD_IP_ENV})")
    return ["slipstream", "run", *flags, *TEE_FLAGS, *entry_argv(spec)]


def prewarm_command(spec: JobSpec) -> list[str] | None:
    """``slipstream data prewarm SOURCE --cache DIR ...`` when the spec asks for a prewarmed cache."""
    d = spec.data
    if not (d and d.prewarm and d.cache_dir):
        return None
    cmd = ["slipstream", "data", "prewarm", d.source, "--cache", d.cache_dir]
    if d.cache_size:
        # 90% of the emptyDir's sizeLimit: the kubelet evicts a pod whose
        # emptyDir grows past its limit, so eviction by the cache must come first.
        gigabytes = parse_quantity(d.cache_size) * CACHE_FILL / Decimal(10**9)
        cmd += ["--max-cache-gb", format(gigabytes.quantize(Decimal("0.001")).normalize(), "f")]
    return cmd


__all__ = ["launcher_flags", "entry_argv", "resolved_env", "resolved_entry_argv", "launcher_command", "prewarm_command", "POD_IP_ENV", "CACHE_FILL",
           "RANK_PREFIX", "RANK_PREFIX_ENV", "TEE_FLAGS"]
