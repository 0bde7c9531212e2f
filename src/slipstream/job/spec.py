"""The job spec: one YAML file that runs on a laptop, an emulated cluster and Kubernetes.

``load_spec(path)`` reads and checks a file and returns a frozen :class:`JobSpec`.
Every problem is reported at once, each as ``field: rule, got value``; the
whole lot is raised as one :class:`~slipstream.errors.ConfigError` (exit code 2).
The schema, with every default, is documented in docs/job.md.

Example::

    spec = load_spec("examples/jobs/mlp.yaml")
    spec.replicas, spec.procs_per_replica   # (2, 1)
    parse_spec({"name": "x", "image": "i", "command": ["python", "t.py"], "replicas": 0})
    # ConfigError: replicas: must be >= 1, got 0
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml

from ..errors import ConfigError, UsageError
from .quantity import parse_quantity, quantity_text

KINDS = ("training", "inference")
PRECISIONS = ("fp32", "bf16", "fp16")
RDZV_PORT = 29400
"""Port of the c10d rendezvous store on replica 0 (same as torchrun's default)."""
TIME_SLICED_RESOURCE = "nvidia.com/gpu.shared"
"""Resource the NVIDIA device plugin advertises for time-sliced GPUs with renameByDefault."""

_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
NAME_MAX_CHARS = 40
"""Names of pods, services and hostnames are built from the job name (plus up to
22 characters such as "-node-0-12" and a random suffix) and must stay <= 63."""
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IMAGE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-/:@+]*$")
_MIG_RE = re.compile(r"^(mig-)?([1-9][0-9]?)g\.([1-9][0-9]*)gb$")
_RESOURCE_RE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_URL_SCHEME_RE = re.compile(r"^([a-z][a-z0-9+.\-]*)://")
_PYTHON_RE = re.compile(r"^(.*/)?python(3(\.[0-9]+)?)?$")


# ---------------------------------------------------------------------------- spec objects


@dataclass(frozen=True)
class GpuSlice:
    mig: str | None = None
    """MIG profile, normalised to ``mig-<g>g.<mem>gb``; resource ``nvidia.com/<profile>``."""
    time_sliced: bool = False
    """Request ``nvidia.com/gpu.shared`` (a time-sliced share) instead of whole GPUs."""
    memory_fraction: float | None = None
    """Cap each process's CUDA caching allocator at this fraction of its GPU."""


@dataclass(frozen=True)
class Restarts:
    max_restarts: int = 3
    """Worker-group restarts by the elastic agent (locally and inside each pod)."""
    max_pod_restarts: int = 3
    """Failed pods Kubernetes replaces (per index / JobSet restarts / backoffLimit)."""


@dataclass(frozen=True)
class Elastic:
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True)
class Checkpoint:
    dir: str
    volume_claim: str | None = None
    interval_steps: int | None = None
    interval_s: float | None = None
    keep_last: int = 3


@dataclass(frozen=True)
class Data:
    source: str
    cache_dir: str | None = None
    cache_size: str | None = None
    prewarm: bool = False


@dataclass(frozen=True)
class Sync:
    strategy: str = "allreduce"
    precision: str = "fp32"
    accumulate_steps: int = 1
    bucket_cap_mb: float = 25.0


@dataclass(frozen=True)
class Network:
    rdma_resource: str | None = None
    rdma_count: int = 1
    host_network: bool = False


@dataclass(frozen=True)
class Serve:
    port: int = 8000
    health_path: str | None = None


@dataclass(frozen=True)
class Entrypoint:
    """The training command as ``slipstream run`` takes it: a script or ``-m module``."""

    target: str
    module: bool
    args: tuple[str, ...]

    def run_argv(self) -> list[str]:
        """``["-m", "pkg.train", "--x"]`` or ``["train.py", "--x"]``: what follows the launcher flags."""
        return (["-m", self.target] if self.module else [self.target]) + list(self.args)


@dataclass(frozen=True)
class JobSpec:
    """A checked job spec; see docs/job.md for every key."""

    name: str
    image: str
    command: tuple[str, ...]
    args: tuple[str, ...] = ()
    kind: str = "training"
    namespace: str | None = None
    replicas: int = 1
    gpu_count: int = 0
    processes_per_replica: int | None = None
    cpu: str | None = None
    memory: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    gpu_slice: GpuSlice = field(default_factory=GpuSlice)
    restarts: Restarts = field(default_factory=Restarts)
    elastic: Elastic | None = None
    checkpoint: Checkpoint | None = None
    data: Data | None = None
    sync: Sync = field(default_factory=Sync)
    queue: str | None = None
    priority_class: str | None = None
    network: Network = field(default_factory=Network)
    shm_size: str | None = None
    serve: Serve | None = None
    source_path: str | None = field(default=None, compare=False)

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
            env.update(_train_config_env(self.sync, self.checkpoint))
        if self.data:
            d = self.data
            env["SLIPSTREAM_DATA_SOURCE"] = d.source
            if d.cache_dir:
                env["SLIPSTREAM_DATA_CACHE_DIR"] = d.cache_dir
            if d.prewarm:
                env["SLIPSTREAM_DATA_PREWARM"] = "1"
        if self.gpu_slice.memory_fraction is not None:
            env["SLIPSTREAM_GPU_MEMORY_FRACTION"] = _num_text(self.gpu_slice.memory_fraction)
        return env


def _num_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def _train_config_env(sync: Sync, checkpoint: Checkpoint | None) -> dict[str, str]:
    """Sync and checkpoint options as the SLIPSTREAM_* variables TrainConfig reads back.

    Going through :class:`slipstream.config.TrainConfig` keeps the names and the
    checks in one place (the same ones ``slipstream run --checkpoint-dir ...`` uses).
    """
    from ..config import TrainConfig

    values: dict[str, object] = {
        "sync": sync.strategy,
        "precision": sync.precision,
        "accumulate_steps": sync.accumulate_steps,
        "bucket_cap_mb": sync.bucket_cap_mb,
    }
    if checkpoint is not None:
        values.update(
            checkpoint_dir=checkpoint.dir,
            checkpoint_every_steps=checkpoint.interval_steps,
            checkpoint_every_s=checkpoint.interval_s,
            checkpoint_keep_last=checkpoint.keep_last,
        )
    try:
        cfg = TrainConfig.from_env(environ={}, **values)
    except ConfigError as exc:  # the spec checks the same rules first; this is a safety net
        raise ConfigError(f"sync/checkpoint: {exc}") from None
    return cfg.to_env()


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


# ---------------------------------------------------------------------------- reading


class _Errors:
    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, path: str, message: str) -> None:
        self.items.append(f"{path}: {message}")


def _show(value: Any) -> str:
    """A value as errors show it: repr for strings, YAML-ish for the rest, kept short."""
    text = repr(value) if not isinstance(value, bool) else str(value).lower()
    if value is None:
        text = "null"
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping"}.get(
        type(value), type(value).__name__
    )


class _Section:
    """Typed access to one mapping of the spec, recording errors with their path."""

    def __init__(self, data: Mapping[str, Any], path: str, errors: _Errors, known: tuple[str, ...]):
        self.data = data
        self.path = path
        self.errors = errors
        for key in data:
            if not isinstance(key, str):
                errors.add(self._p(str(key)), f"keys must be strings, got {_show(key)}")
                continue
            if key not in known:
                hint = difflib.get_close_matches(key, known, n=1)
                extra = f" (did you mean {hint[0]!r}?)" if hint else f"; known keys: {', '.join(known)}"
                errors.add(self._p(key), f"unknown key{extra}")

    def _p(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def int(self, key: str, default: int | None, minimum: int | None = None, maximum: int | None = None) -> int | None:
        v = self.data.get(key, None)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            self.errors.add(self._p(key), f"must be a whole number, got {_type_name(v)} {_show(v)}")
            return default
        if minimum is not None and v < minimum:
            self.errors.add(self._p(key), f"must be >= {minimum}, got {v}")
            return default
        if maximum is not None and v > maximum:
            self.errors.add(self._p(key), f"must be <= {maximum}, got {v}")
            return default
        return v

    def float(self, key: str, default: float | None, low: float, low_open: bool, high: float | None = None) -> float | None:
        v = self.data.get(key, None)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
            self.errors.add(self._p(key), f"must be a finite number, got {_type_name(v)} {_show(v)}")
            return default
        if (low_open and v <= low) or (not low_open and v < low):
            self.errors.add(self._p(key), f"must be {'>' if low_open else '>='} {_num_text(low)}, got {_show(v)}")
            return default
        if high is not None and v > high:
            self.errors.add(self._p(key), f"must be <= {_num_text(high)}, got {_show(v)}")
            return default
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.data.get(key, None)
        if v is None:
            return default
        if not isinstance(v, bool):
            self.errors.add(self._p(key), f"must be true or false, got {_type_name(v)} {_show(v)}")
            return default
        return v

    def str(self, key: str, default: str | None, pattern: re.Pattern | None = None, rule: str = "",
            max_len: int | None = None) -> str | None:
        v = self.data.get(key, None)
        if v is None:
            return default
        if not isinstance(v, str):
            self.errors.add(self._p(key), f"must be a string, got {_type_name(v)} {_show(v)}")
            return default
        if v == "" or v.strip() != v:
            self.errors.add(self._p(key), f"must be a non-empty string without surrounding spaces, got {_show(v)}")
            return default
        if max_len is not None and len(v) > max_len:
            self.errors.add(self._p(key), f"must be at most {max_len} characters, got {len(v)} ({_show(v)})")
            return default
        if pattern is not None and not pattern.match(v):
            self.errors.add(self._p(key), f"must be {rule}, got {_show(v)}")
            return default
        return v

    def choice(self, key: str, default: str, choices: tuple[str, ...]) -> str:
        v = self.data.get(key, None)
        if v is None:
            return default
        if not isinstance(v, str) or v not in choices:
            self.errors.add(self._p(key), f"must be one of {', '.join(choices)}, got {_show(v)}")
            return default
        return v

    def quantity(self, key: str, positive: bool = True) -> str | None:
        v = self.data.get(key, None)
        if v is None:
            return None
        try:
            amount = parse_quantity(v)
        except ValueError:
            self.errors.add(
                self._p(key),
                f"must be a Kubernetes quantity (e.g. 4, 500m, 16Gi), got {_type_name(v)} {_show(v)}",
            )
            return None
        if positive and amount <= 0:
            self.errors.add(self._p(key), f"must be > 0, got {_show(v)}")
            return None
        return quantity_text(v)

    def str_list(self, key: str, required: bool) -> tuple[str, ...] | None:
        v = self.data.get(key, None)
        if v is None:
            if required:
                self.errors.add(self._p(key), "is required (a list of strings, e.g. [python, train.py])")
            return None
        if not isinstance(v, list):
            self.errors.add(self._p(key), f"must be a list of strings, got {_type_name(v)} {_show(v)}")
            return None
        ok = True
        for i, item in enumerate(v):
            if not isinstance(item, str):
                self.errors.add(f"{self._p(key)}[{i}]", f"must be a string, got {_type_name(item)} {_show(item)}")
                ok = False
        return tuple(v) if ok else None

    def section(self, key: str, known: tuple[str, ...]) -> "_Section | None":
        v = self.data.get(key, None)
        if v is None:
            return None
        if not isinstance(v, dict):
            self.errors.add(self._p(key), f"must be a mapping, got {_type_name(v)} {_show(v)}")
            return None
        return _Section(v, self._p(key), self.errors, known)


_TOP_KEYS = (
    "name", "kind", "namespace", "image", "command", "args", "replicas", "gpu_count",
    "processes_per_replica", "cpu", "memory", "env", "gpu_slice", "restarts", "elastic",
    "checkpoint", "data", "sync", "queue", "priority_class", "network", "shm_size", "serve",
)
_TRAINING_ONLY = ("processes_per_replica", "restarts", "elastic", "checkpoint", "data", "sync")
_DNS_LABEL_RULE = "a DNS-1123 label (lower-case letters, digits and '-', starting with a letter and ending with a letter or digit)"


def parse_spec(data: Any, source_path: str | None = None) -> JobSpec:
    """Check a mapping (as loaded from YAML) and build a :class:`JobSpec`.

    Raises :class:`ConfigError` listing every problem found.
    """
    where = f"{source_path}: " if source_path else ""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}the job spec must be a mapping of keys (name, image, command, ...), got {_type_name(data)}")
    errors = _Errors()
    top = _Section(data, "", errors, _TOP_KEYS)

    name = top.str("name", None, _NAME_RE, _DNS_LABEL_RULE, max_len=NAME_MAX_CHARS)
    if "name" not in data or data["name"] is None:
        errors.add("name", "is required (a DNS-1123 label, e.g. mlp-train)")
    kind = top.choice("kind", "training", KINDS)
    namespace = top.str("namespace", None, _NAME_RE, _DNS_LABEL_RULE, max_len=63)
    image = top.str("image", None, _IMAGE_RE, "a container image reference (e.g. ghcr.io/org/slipstream:0.1.0)", max_len=512)
    if "image" not in data or data["image"] is None:
        errors.add("image", "is required (the container image the replicas run)")
    command = top.str_list("command", required=True)
    args = top.str_list("args", required=False) or ()
    if command is not None and len(command) == 0:
        errors.add("command", "must not be empty, got []")
        command = None
    if command is not None and kind == "training":
        try:
            parse_entrypoint(list(command) + list(args))
        except ValueError as exc:
            errors.add("command", str(exc))

    replicas = top.int("replicas", 1, minimum=1, maximum=10000)
    gpu_count = top.int("gpu_count", 0, minimum=0, maximum=64)
    procs = top.int("processes_per_replica", None, minimum=1, maximum=1024)
    if procs is not None and gpu_count and procs > gpu_count:
        errors.add("processes_per_replica", f"must be <= gpu_count ({gpu_count}) when GPUs are requested, got {procs}")
    cpu = top.quantity("cpu")
    memory = top.quantity("memory")
    shm_size = top.quantity("shm_size")
    if shm_size and memory and parse_quantity(shm_size) > parse_quantity(memory):
        errors.add("shm_size", f"must be <= memory ({memory}): /dev/shm counts against the memory limit, got {shm_size!r}")

    env = _read_env(data.get("env"), errors)

    gpu_slice = _read_gpu_slice(top, gpu_count or 0, errors)
    restarts = _read_restarts(top)
    elastic = _read_elastic(top, replicas or 1, errors)
    checkpoint = _read_checkpoint(top, errors)
    data_sec = _read_data(top, errors)
    sync = _read_sync(top, errors)
    queue = top.str("queue", None, _NAME_RE, _DNS_LABEL_RULE + " naming a Kueue LocalQueue", max_len=63)
    priority_class = top.str("priority_class", None, _NAME_RE, _DNS_LABEL_RULE + " naming a PriorityClass", max_len=63)
    network = _read_network(top)
    serve = _read_serve(top, errors)

    if kind == "inference":
        for key in _TRAINING_ONLY:
            if top.has(key):
                errors.add(key, "is only for kind training, got kind inference")
    elif top.has("serve"):
        errors.add("serve", "is only for kind inference, got kind training")

    if errors.items:
        if len(errors.items) == 1:
            raise ConfigError(f"{where}{errors.items[0]}")
        lines = "\n".join(f"  {e}" for e in errors.items)
        raise ConfigError(f"{where}{len(errors.items)} problems in the job spec:\n{lines}")

    return JobSpec(
        name=name, image=image, command=tuple(command), args=tuple(args), kind=kind, namespace=namespace,
        replicas=replicas, gpu_count=gpu_count, processes_per_replica=procs, cpu=cpu, memory=memory,
        env=env, gpu_slice=gpu_slice, restarts=restarts, elastic=elastic, checkpoint=checkpoint,
        data=data_sec, sync=sync, queue=queue, priority_class=priority_class, network=network,
        shm_size=shm_size, serve=(serve or Serve()) if kind == "inference" else None,
        source_path=source_path,
    )


def _read_env(raw: Any, errors: _Errors) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        errors.add("env", f"must be a mapping of NAME: value, got {_type_name(raw)} {_show(raw)}")
        return ()
    out = []
    for key, value in raw.items():
        path = f"env.{key}"
        if not isinstance(key, str) or not _ENV_NAME_RE.match(key):
            errors.add(path, f"name must match [A-Za-z_][A-Za-z0-9_]*, got {_show(key)}")
            continue
        if any(key == p or (p.endswith("_") and key.startswith(p)) for p in GENERATED_ENV_PREFIXES):
            errors.add(path, "is set by the spec itself (sync, checkpoint, data, gpu_slice sections); set it there, got an env entry")
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif isinstance(value, (int, float)) and value == value:
            value = str(value)
        elif not isinstance(value, str):
            errors.add(path, f"must be a string, number or boolean, got {_type_name(value)} {_show(value)}")
            continue
        out.append((key, value))
    return tuple(out)


def _read_gpu_slice(top: _Section, gpu_count: int, errors: _Errors) -> GpuSlice:
    sec = top.section("gpu_slice", ("mig", "time_sliced", "memory_fraction"))
    if sec is None:
        return GpuSlice()
    mig = sec.str("mig", None, _MIG_RE, "a MIG profile such as mig-1g.10gb or 3g.40gb")
    if mig is not None and not mig.startswith("mig-"):
        mig = "mig-" + mig
    time_sliced = sec.bool("time_sliced", False)
    fraction = sec.float("memory_fraction", None, 0.0, True, 1.0)
    if mig and time_sliced:
        errors.add("gpu_slice", f"mig and time_sliced are exclusive, got mig {mig!r} and time_sliced true")
    if (mig or time_sliced or fraction is not None) and gpu_count == 0:
        errors.add("gpu_slice", "needs gpu_count >= 1 (a slice of what?), got gpu_count 0")
    return GpuSlice(mig=mig, time_sliced=time_sliced, memory_fraction=fraction)


def _read_restarts(top: _Section) -> Restarts:
    sec = top.section("restarts", ("max_restarts", "max_pod_restarts"))
    if sec is None:
        return Restarts()
    r = sec.int("max_restarts", 3, minimum=0, maximum=1000)
    return Restarts(max_restarts=r, max_pod_restarts=sec.int("max_pod_restarts", r, minimum=0, maximum=1000))


def _read_elastic(top: _Section, replicas: int, errors: _Errors) -> Elastic | None:
    sec = top.section("elastic", ("min_replicas", "max_replicas"))
    if sec is None:
        return None
    lo = sec.int("min_replicas", replicas, minimum=1, maximum=10000)
    hi = sec.int("max_replicas", replicas, minimum=1, maximum=10000)
    if lo > replicas:
        errors.add("elastic.min_replicas", f"must be <= replicas ({replicas}), got {lo}")
    elif hi < replicas:
        errors.add("elastic.max_replicas", f"must be >= replicas ({replicas}), got {hi}")
    return Elastic(lo, hi)


def _read_checkpoint(top: _Section, errors: _Errors) -> Checkpoint | None:
    sec = top.section("checkpoint", ("dir", "volume_claim", "interval_steps", "interval_s", "keep_last"))
    if sec is None:
        return None
    d = sec.str("dir", None, max_len=1024)
    if not sec.has("dir"):
        errors.add("checkpoint.dir", "is required when checkpoint is given (a path, or an fsspec URL such as s3://bucket/ckpt)")
    claim = sec.str("volume_claim", None, re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"),
                    "a PersistentVolumeClaim name (DNS-1123 subdomain)", max_len=253)
    if claim and d and (_URL_SCHEME_RE.match(d) or not d.startswith("/")):
        errors.add("checkpoint.dir", f"must be an absolute path (the volume claim is mounted there), got {d!r}")
    steps = sec.int("interval_steps", None, minimum=1)
    secs = sec.float("interval_s", None, 0.0, True)
    keep = sec.int("keep_last", 3, minimum=1, maximum=1000)
    return Checkpoint(dir=d or "", volume_claim=claim, interval_steps=steps, interval_s=secs, keep_last=keep)


def _read_data(top: _Section, errors: _Errors) -> Data | None:
    sec = top.section("data", ("source", "cache_dir", "cache_size", "prewarm"))
    if sec is None:
        return None
    src = sec.str("source", None, max_len=2048)
    if not sec.has("source"):
        errors.add("data.source", "is required when data is given (a path or URL such as s3://bucket/shards)")
    cache = sec.str("cache_dir", None, max_len=1024)
    if cache is not None and not cache.startswith("/") and not cache.startswith("."):
        errors.add("data.cache_dir", f"must be a local path (absolute, or relative starting with .), got {cache!r}")
    size = sec.quantity("cache_size")
    if size and not cache:
        errors.add("data.cache_size", f"needs data.cache_dir (the size of what?), got {size!r}")
    return Data(source=src or "", cache_dir=cache, cache_size=size, prewarm=sec.bool("prewarm", False))


def _read_sync(top: _Section, errors: _Errors) -> Sync:
    sec = top.section("sync", ("strategy", "precision", "accumulate_steps", "bucket_cap_mb"))
    if sec is None:
        return Sync()
    strategy = sec.str("strategy", "allreduce", max_len=64)
    if sec.has("strategy") and strategy != "allreduce":
        from .. import sync as _sync

        known = _sync.available()
        if strategy not in known:
            errors.add("sync.strategy", f"must be one of {', '.join(known)}, got {strategy!r}")
            strategy = "allreduce"
    return Sync(
        strategy=strategy,
        precision=sec.choice("precision", "fp32", PRECISIONS),
        accumulate_steps=sec.int("accumulate_steps", 1, minimum=1, maximum=100000),
        bucket_cap_mb=sec.float("bucket_cap_mb", 25.0, 0.0, True, 65536.0),
    )


def _read_network(top: _Section) -> Network:
    sec = top.section("network", ("rdma_resource", "rdma_count", "host_network"))
    if sec is None:
        return Network()
    res = sec.str("rdma_resource", None, _RESOURCE_RE, "an extended resource name such as rdma/hca", max_len=253)
    return Network(rdma_resource=res, rdma_count=sec.int("rdma_count", 1, minimum=1, maximum=64),
                   host_network=sec.bool("host_network", False))


def _read_serve(top: _Section, errors: _Errors) -> Serve | None:
    sec = top.section("serve", ("port", "health_path"))
    if sec is None:
        return None
    port = sec.int("port", 8000, minimum=1, maximum=65535)
    if port == RDZV_PORT:
        errors.add("serve.port", f"must not be {RDZV_PORT} (reserved for the training rendezvous), got {port}")
    path = sec.str("health_path", None, re.compile(r"^/[!-~]*$"), "an absolute HTTP path such as /healthz")
    return Serve(port=port, health_path=path)


# ---------------------------------------------------------------------------- files


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, f"unhashable key {key!r}", key_node.start_mark) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_spec_text(text: str, source_path: str | None = None) -> JobSpec:
    """Parse YAML text into a checked :class:`JobSpec`."""
    where = source_path or "<spec>"
    try:
        docs = [d for d in yaml.load_all(text, Loader=_StrictLoader)]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        pos = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML{pos}: {problem}") from None
    docs = [d for d in docs if d is not None]
    if len(docs) != 1:
        raise ConfigError(f"{where}: must hold exactly one YAML document (the job spec), got {len(docs)}")
    return parse_spec(docs[0], source_path=source_path)


def load_spec(path: str | os.PathLike) -> JobSpec:
    """Read and check a job spec file; see :func:`parse_spec`."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise UsageError(f"job spec not found: {path}") from None
    except IsADirectoryError:
        raise UsageError(f"job spec is a directory, not a file: {path}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UsageError(f"cannot read job spec {path}: {exc.strerror}") from None
    return load_spec_text(text, source_path=path)


def is_job_file(path: str) -> bool:
    """True for paths ``slipstream run`` treats as a job spec (``.yaml`` / ``.yml``)."""
    return path.lower().endswith((".yaml", ".yml"))


__all__ = [
    "JobSpec", "GpuSlice", "Restarts", "Elastic", "Checkpoint", "Data", "Sync", "Network", "Serve",
    "Entrypoint", "parse_spec", "load_spec", "load_spec_text", "parse_entrypoint", "is_job_file",
    "RDZV_PORT", "KINDS", "NAME_MAX_CHARS",
]
