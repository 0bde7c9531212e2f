"""The job spec's objects: frozen dataclasses whose fields are the YAML keys, each with its rule.

The field helpers (:mod:`slipstream.job.fields`) put every key's type, bounds,
pattern, enum, default and documentation on the field itself; the reader, the
error messages and the published JSON Schema all come from these declarations.
A key that feeds a TrainConfig setting (checkpoint, sync, numerics, parallel) is
declared by that setting (:func:`~slipstream.job.fields.from_config`): its default,
bounds, choices and documentation are the config field's, so the spec cannot
disagree with ``slipstream run``'s flags or ``accelerate()``.

Example::

    from slipstream.job.spec import parse_spec
    spec = parse_spec({"name": "a", "image": "i", "command": ["python", "t.py"], "gpu_count": 2})
    spec.procs_per_replica, spec.numerics.precision     # (2, "fp32")
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .fields import (boolean, choice, env_mapping, from_config, integer, number, quantity, rules, section, string,
                     strings)

if TYPE_CHECKING:
    from ..config import TrainConfig

KINDS = ("training", "inference")
RDZV_PORT = 29400
"""Port of the c10d rendezvous store on replica 0 (same as torchrun's default)."""
TIME_SLICED_RESOURCE = "nvidia.com/gpu.shared"
"""Resource the NVIDIA device plugin advertises for time-sliced GPUs with renameByDefault."""
NAME_MAX_CHARS = 40
"""Names of pods, services and hostnames are built from the job name (plus up to
22 characters such as "-node-0-12" and a random suffix) and must stay <= 63."""

NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
_IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-/:@+]*$"
_MIG_PATTERN = r"^(mig-)?([1-9][0-9]?)g\.([1-9][0-9]*)gb$"
_RESOURCE_PATTERN = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_PVC_PATTERN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
_HTTP_PATH_PATTERN = r"^/[!-~]*$"
_SLURM_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$"
_SLURM_TIME_PATTERN = r"^([0-9]+-[0-9]+(:[0-9]+){0,2}|[0-9]+(:[0-9]+){0,2})$"
_PYTHON_RE = re.compile(r"^(.*/)?python(3(\.[0-9]+)?)?$")
DNS_LABEL_RULE = ("a DNS-1123 label (lower-case letters, digits and '-', starting with a letter and ending "
                  "with a letter or digit)")

# Names the spec itself sets; a user env entry of the same name would silently
# fight with the spec, so it is refused.
GENERATED_ENV_PREFIXES = (
    "SLIPSTREAM_JOB_NAME",
    "SLIPSTREAM_SYNC",
    "SLIPSTREAM_PRECISION",
    "SLIPSTREAM_ACCUMULATE_STEPS",
    "SLIPSTREAM_BUCKET_CAP_MB",
    "SLIPSTREAM_CHECKPOINT_",
    "SLIPSTREAM_DATA_",
    "SLIPSTREAM_GPU_MEMORY_FRACTION",
    "SLIPSTREAM_POD_IP",
)


def sync_strategies() -> tuple[str, ...]:
    """Every strategy the installed engine accepts (imported late: it needs torch.distributed)."""
    from .. import sync

    return tuple(sync.available())


def _mig_name(profile: str) -> str:
    return profile if profile.startswith("mig-") else "mig-" + profile


# ---------------------------------------------------------------------------- sections


@dataclass(frozen=True, kw_only=True)
class GpuSlice:
    mig: str | None = string(
        pattern=_MIG_PATTERN, rule="a MIG profile such as mig-1g.10gb or 3g.40gb", normalize=_mig_name,
        doc="MIG profile (mig-1g.10gb, 3g.40gb): request gpu_count devices nvidia.com/mig-<profile> instead of "
            "whole GPUs. Kept as mig-<g>g.<mem>gb.")
    time_sliced: bool = boolean(
        False, doc="Request nvidia.com/gpu.shared (a time-sliced share) instead of whole GPUs. Exclusive with mig.")
    memory_fraction: float | None = number(
        minimum=0.0, exclusive_minimum=True, maximum=1.0,
        doc="Cap each worker's CUDA caching allocator at this fraction of its GPU.")


@dataclass(frozen=True, kw_only=True)
class Restarts:
    max_restarts: int = integer(
        3, minimum=0, maximum=1000,
        doc="Worker-group restarts by the elastic agent (locally and inside each pod).")
    max_pod_restarts: int = integer(
        3, minimum=0, maximum=1000, default_from="max_restarts", default_doc="max_restarts",
        doc="Failed pods Kubernetes replaces (per index / JobSet restarts / backoffLimit).")
    heal: bool = boolean(
        True, doc="Heal a rank whose process dies in place (slipstream run --heal): the other ranks keep their "
                  "processes and the group forms again; false (--no-heal): a failed rank restarts every worker. "
                  "On only where it applies: more than one worker process in one replica. Across replicas the "
                  "launcher's default is off (a lost replica comes back through the rendezvous, which "
                  "restarts every worker).")
    spares: int = integer(
        1, minimum=0, maximum=1,
        doc="Warm spare processes each rank keeps for healing (slipstream run --spares); 0: a replacement "
            "starts cold, seconds later, and costs no memory until then.")


@dataclass(frozen=True, kw_only=True)
class Elastic:
    min_replicas: int = integer(
        None, minimum=1, maximum=10000, default_from="replicas", default_doc="replicas",
        doc="Fewest replicas the job continues with (at most replicas).")
    max_replicas: int = integer(
        None, minimum=1, maximum=10000, default_from="replicas", default_doc="replicas",
        doc="Most replicas that may join (at least replicas).")


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    dir: str = from_config(
        "checkpoint_dir", required="when checkpoint is given (a path, or an fsspec URL such as s3://bucket/ckpt)",
        note="A path (/ckpt/run1) or an fsspec URL (s3://bucket/run1).")
    volume_claim: str | None = string(
        pattern=_PVC_PATTERN, rule="a PersistentVolumeClaim name (DNS-1123 subdomain)", max_len=253,
        doc="PersistentVolumeClaim mounted at dir (which must then be an absolute path).")
    # Keys that feed a TrainConfig setting take its default, bounds and documentation (from_config);
    # engine_default: absent, the engine's default applies (and the spec names no value of its own).
    every_steps: int | None = from_config("checkpoint_every_steps", note="Was interval_steps.")
    every_s: float | None = from_config("checkpoint_every_s", note="Was interval_s.")
    keep_last: int = from_config("checkpoint_keep_last")
    verify: str | None = from_config("checkpoint_verify", engine_default=True)
    max_failures: int | None = from_config("checkpoint_max_failures", engine_default=True)
    snapshot_every_steps: int | None = from_config("snapshot_every_steps", note="Give pods enough shm_size.")


@dataclass(frozen=True, kw_only=True)
class Data:
    source: str = string(
        max_len=2048, required="when data is given (a path or URL such as s3://bucket/shards)",
        doc="Where the shards are (s3://bucket/shards, /data/shards): SLIPSTREAM_DATA_SOURCE.")
    cache_dir: str | None = string(
        max_len=1024, doc="Node-local cache directory (absolute, or relative starting with .); on Kubernetes an "
                          "emptyDir is mounted there.")
    cache_size: str | None = quantity(doc="sizeLimit of the cache's emptyDir; needs cache_dir.")
    prewarm: bool = boolean(
        False, doc="Fill the cache before training starts (slipstream data prewarm): an init container in "
                   "each pod, once before the replicas in a local run.")


@dataclass(frozen=True, kw_only=True)
class Sync:
    strategy: str = from_config("sync", enum=sync_strategies)
    bucket_cap_mb: float = from_config("bucket_cap_mb")


@dataclass(frozen=True, kw_only=True)
class Numerics:
    """Precision and accumulation: TrainConfig's ``numerics`` section (was under ``sync``)."""

    precision: str = from_config("precision", note="Was sync.precision.")
    accumulate_steps: int = from_config("accumulate_steps", note="Was sync.accumulate_steps.")


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """The parallel layout (docs/parallel.md): dp_replicate * dp_shard * tp * pp = world size."""

    dp_replicate: int | None = from_config("dp_replicate", engine_default=True)
    dp_shard: int | None = from_config("dp_shard", engine_default=True)
    tp: int | None = from_config("tp", engine_default=True)
    pp: int | None = from_config("pp", engine_default=True)
    pp_schedule: str | None = from_config("pp_schedule", engine_default=True)
    pp_microbatches: int | None = from_config("pp_microbatches", engine_default=True)
    zero_stage: int | None = from_config("zero_stage", engine_default=True)


@dataclass(frozen=True, kw_only=True)
class Network:
    rdma_resource: str | None = string(
        pattern=_RESOURCE_PATTERN, rule="an extended resource name such as rdma/hca", max_len=253,
        doc="Extended resource of an RDMA device (rdma/hca), requested rdma_count times per replica.")
    rdma_count: int = integer(1, minimum=1, maximum=64, doc="How many rdma_resource devices per replica.")
    host_network: bool = boolean(False, doc="Pods use the node's network (hostNetwork: true); port 29400 (and 29401, "
                                            "the healing store, unless restarts.heal is false) must then be free on "
                                            "the nodes.")


@dataclass(frozen=True, kw_only=True)
class Slurm:
    """Options of the Slurm target only (``slipstream render/submit --target slurm``); other targets ignore them."""

    partition: str | None = string(pattern=_SLURM_NAME_PATTERN, rule="a Slurm partition name", max_len=128,
                                   doc="sbatch --partition; none: the cluster's default partition.")
    account: str | None = string(pattern=_SLURM_NAME_PATTERN, rule="a Slurm account name", max_len=128,
                                 doc="sbatch --account; none: the user's default account.")
    qos: str | None = string(pattern=_SLURM_NAME_PATTERN, rule="a Slurm QOS name", max_len=128,
                             doc="sbatch --qos; none: the association's default QOS.")
    time: str | None = string(
        pattern=_SLURM_TIME_PATTERN, rule="a Slurm time limit (MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)",
        max_len=32, doc="Time limit (sbatch --time); none: the partition's.")
    signal_grace_s: int = integer(
        120, minimum=10, maximum=86400,
        doc="SIGTERM reaches the agents this many seconds before the time limit (sbatch --signal=TERM@N): time "
            "for the emergency checkpoint, after which the job requeues itself.")
    requeue: bool = boolean(True, doc="A preempted job (exit 143 after its emergency checkpoint) is requeued "
                                      "(sbatch --requeue, scontrol requeue) and resumes from the checkpoint.")


@dataclass(frozen=True, kw_only=True)
class Serve:
    port: int = integer(8000, minimum=1, maximum=65535,
                        doc=f"Container port of the service (not {RDZV_PORT}, the training rendezvous).")
    health_path: str | None = string(
        pattern=_HTTP_PATH_PATTERN, rule="an absolute HTTP path such as /healthz",
        doc="HTTP path of the readiness probe (httpGet); none: no probe.")


@dataclass(frozen=True)
class Entrypoint:
    """The training command as ``slipstream run`` takes it: a script or ``-m module``."""

    target: str
    module: bool
    args: tuple[str, ...]

    def run_argv(self) -> list[str]:
        """``["-m", "pkg.train", "--x"]`` or ``["train.py", "--x"]``: what follows the launcher flags."""
        return (["-m", self.target] if self.module else [self.target]) + list(self.args)


# ---------------------------------------------------------------------------- the spec


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A checked job spec; see docs/job.md for every key. Field order is the key order of messages."""

    name: str = string(
        pattern=NAME_PATTERN, rule=DNS_LABEL_RULE, max_len=NAME_MAX_CHARS, required="(a DNS-1123 label, e.g. mlp-train)",
        doc="Job name; Kubernetes object names, pod host names and the rendezvous id derive from it.")
    kind: str = choice("training", KINDS, doc="training, or inference (a Deployment and a Service).")
    namespace: str | None = string(pattern=NAME_PATTERN, rule=DNS_LABEL_RULE, max_len=63,
                                   doc="Namespace written into the manifests; none: kubectl's current one.")
    image: str = string(
        pattern=_IMAGE_PATTERN, rule="a container image reference (e.g. ghcr.io/org/slipstream:0.1.0)", max_len=512,
        required="(the container image the replicas run)", doc="Container image of every replica.")
    command: tuple[str, ...] = strings(
        min_items=1, required="(a list of strings, e.g. [python, train.py])",
        doc="Training: [python, train.py], [python3, -u, train.py], [python, -m, pkg.train] or [train.py]. "
            "Inference: any command.")
    args: tuple[str, ...] = strings((), doc="Appended to command (as in Kubernetes).")
    replicas: int = integer(1, minimum=1, maximum=10000, doc="Distributed replicas = nodes (pods).")
    gpu_count: int = integer(0, minimum=0, maximum=64,
                             doc="GPUs (or GPU slices) per replica, and worker processes per replica; 0: one CPU "
                                 "process (gloo).")
    processes_per_replica: int | None = integer(
        minimum=1, maximum=1024, only_for="training", default_doc="gpu_count, or 1",
        doc="Worker processes per replica; at most gpu_count when GPUs are requested.")
    cpu: str | None = quantity(doc="CPU request per replica (Kubernetes quantity: 4, 500m).")
    memory: str | None = quantity(doc="Memory request and limit per replica (Kubernetes quantity: 16Gi).")
    env: tuple[tuple[str, str], ...] = env_mapping(
        pattern=ENV_NAME_PATTERN, reserved=GENERATED_ENV_PREFIXES, doc="Extra environment for every worker; numbers and booleans become strings. Names the spec sets "
            "itself (SLIPSTREAM_SYNC, SLIPSTREAM_CHECKPOINT_*, ...) are refused.")
    gpu_slice: GpuSlice = section(GpuSlice, doc="A MIG profile or a time-sliced share instead of whole GPUs.")
    restarts: Restarts = section(Restarts, only_for="training", doc="Restart budgets.")
    elastic: Elastic | None = section(Elastic, optional=True, only_for="training",
                                      doc="A range of replicas the job accepts (--nnodes MIN:MAX).")
    checkpoint: Checkpoint | None = section(Checkpoint, optional=True, only_for="training",
                                            doc="Where and how often to checkpoint.")
    data: Data | None = section(Data, optional=True, only_for="training", doc="The data set and its node-local cache.")
    sync: Sync = section(Sync, only_for="training", doc="Gradient synchronisation options.")
    numerics: Numerics = section(Numerics, only_for="training", doc="Precision and gradient accumulation.")
    parallel: Parallel | None = section(Parallel, optional=True, only_for="training",
                                        doc="The parallel layout; absent: data parallel over every process.")
    queue: str | None = string(pattern=NAME_PATTERN, rule=DNS_LABEL_RULE + " naming a Kueue LocalQueue", max_len=63,
                               doc="Kueue LocalQueue (the workload is created suspended).")
    priority_class: str | None = string(
        pattern=NAME_PATTERN, rule=DNS_LABEL_RULE + " naming a PriorityClass", max_len=63,
        doc="PriorityClass of the pods.")
    network: Network = section(Network, doc="Opt-in network hints.")
    slurm: Slurm = section(Slurm, only_for="training", doc="Options of the Slurm target (--target slurm).")
    shm_size: str | None = quantity(doc="Size of /dev/shm (a memory-backed emptyDir, <= memory).")
    serve: Serve | None = section(Serve, optional=True, only_for="inference", doc="The service of kind inference.")
    source_path: str | None = field(default=None, compare=False)  # not a key: the file the spec came from

    # -- derived -------------------------------------------------------------------
    @property
    def procs_per_replica(self) -> int:
        """Worker processes per replica: processes_per_replica, else gpu_count, else 1 (CPU)."""
        if self.processes_per_replica is not None:
            return self.processes_per_replica
        return self.gpu_count if self.gpu_count > 0 else 1

    @property
    def min_replicas(self) -> int:
        return self.elastic.min_replicas if self.elastic else self.replicas

    @property
    def max_replicas(self) -> int:
        return self.elastic.max_replicas if self.elastic else self.replicas

    @property
    def nnodes(self) -> str:
        """``"2"`` or ``"1:4"``, as ``slipstream run --nnodes`` takes it."""
        if self.min_replicas == self.max_replicas:
            return str(self.replicas)
        return f"{self.min_replicas}:{self.max_replicas}"

    @property
    def full_command(self) -> list[str]:
        return list(self.command) + list(self.args)

    @property
    def entrypoint(self) -> Entrypoint:
        """The training entrypoint (training jobs only; checked at load time)."""
        return parse_entrypoint(self.full_command)

    @property
    def gpu_resource(self) -> str | None:
        """Extended resource name the GPUs are requested as, or None for CPU jobs."""
        if self.gpu_count == 0:
            return None
        if self.gpu_slice.mig:
            return f"nvidia.com/{self.gpu_slice.mig}"
        if self.gpu_slice.time_sliced:
            return TIME_SLICED_RESOURCE
        return "nvidia.com/gpu"

    def worker_env(self) -> dict[str, str]:
        """Environment for every worker process: the user's env, then SLIPSTREAM_* options.

        Sync options go through :class:`slipstream.config.TrainConfig` (only the
        non-default ones, as ``TrainConfig.to_env()`` writes them).
        """
        env = dict(self.env)
        env.update(self.generated_env())
        return env

    def generated_env(self) -> dict[str, str]:
        env: dict[str, str] = {"SLIPSTREAM_JOB_NAME": self.name}
        if self.kind == "training":
            env.update(train_config(self).to_env())
        if self.data:
            d = self.data
            env["SLIPSTREAM_DATA_SOURCE"] = d.source
            if d.cache_dir:
                env["SLIPSTREAM_DATA_CACHE_DIR"] = d.cache_dir
            if d.prewarm:
                env["SLIPSTREAM_DATA_PREWARM"] = "1"
        if self.gpu_slice.memory_fraction is not None:
            env["SLIPSTREAM_GPU_MEMORY_FRACTION"] = num_text(self.gpu_slice.memory_fraction)
        return env


def num_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def config_values(spec: JobSpec) -> dict[str, object]:
    """The spec's values for the engine, by flat TrainConfig name (keys declared with ``config=``;
    None, "the engine's default", left out)."""
    out: dict[str, object] = {}
    for name, rule in rules(JobSpec).items():
        part = getattr(spec, name)
        if rule.kind != "section" or part is None:
            continue
        for key, inner in rules(rule.section).items():
            value = getattr(part, key)
            if inner.config is not None and value is not None:
                out[inner.config] = value
    return out


def train_config(spec: JobSpec) -> "TrainConfig":
    """The engine's configuration for this spec's sync, checkpoint and parallel sections.

    Built from flat names and written with ``to_env()`` (only values that differ
    from the engine's defaults), so the names and the checks stay the
    engine's: the same ones ``slipstream run --checkpoint-dir ...`` uses.
    Raises ConfigError for a combination the engine refuses.
    """
    from ..config import TrainConfig

    return TrainConfig.from_env(environ={}, **config_values(spec))


# ---------------------------------------------------------------------------- entrypoint


def parse_entrypoint(command: list[str]) -> Entrypoint:
    """``["python", "-u", "train.py", "--lr", "1"]`` -> Entrypoint("train.py", False, ("--lr", "1")).

    Accepted: ``[python[3[.N]]] [-u] (SCRIPT.py | -m MODULE) ARGS...``. Raises
    ValueError with the rule broken (the caller adds the field name).
    """
    if not command:
        raise ValueError("must not be empty")
    rest = list(command)
    head = rest[0]
    if _PYTHON_RE.match(head):
        rest = rest[1:]
        while rest and rest[0] == "-u":
            rest = rest[1:]
        if not rest:
            raise ValueError(f"must name a script or -m MODULE after {head!r}, got {command!r}")
        if rest[0] == "-m":
            if len(rest) < 2 or not rest[1] or rest[1].startswith("-"):
                raise ValueError(f"-m must be followed by a module name, got {command!r}")
            return Entrypoint(rest[1], True, tuple(rest[2:]))
        if rest[0].startswith("-"):
            raise ValueError(
                f"python option {rest[0]!r} is not supported (supported: -u, -m MODULE), got {command!r}"
            )
        return Entrypoint(rest[0], False, tuple(rest[1:]))
    base = os.path.basename(head)
    if base in ("torchrun", "slipstream") or head.endswith("torch.distributed.run"):
        raise ValueError(
            f"must be the training script itself (python train.py ...): Slipstream starts the "
            f"workers, so {base!r} must not be given, got {command!r}"
        )
    if head.endswith(".py"):
        return Entrypoint(head, False, tuple(rest[1:]))
    raise ValueError(
        f"must start with python (or python3) or a .py script, got {command!r}"
    )


__all__ = [
    "JobSpec", "GpuSlice", "Restarts", "Elastic", "Checkpoint", "Data", "Sync", "Parallel", "Network", "Slurm", "Serve",
    "Entrypoint", "parse_entrypoint", "config_values", "train_config", "sync_strategies", "KINDS", "RDZV_PORT", "NAME_MAX_CHARS", "TIME_SLICED_RESOURCE",
    "GENERATED_ENV_PREFIXES",
]
