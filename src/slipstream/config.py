"""Typed training configuration, validated when built.

The configuration is a tree: :class:`TrainConfig` holds one frozen section per
component (``sync``, ``numerics``, ``parallel``, ``checkpoint``, ``metrics``,
``run``), each checked when built; rules that span sections are checked by
``TrainConfig`` itself. Every leaf also has a flat name (``precision``,
``checkpoint_dir``, ...): the keyword arguments of :func:`slipstream.accelerate`,
the ``SLIPSTREAM_<FLAT_NAME>`` variables and the ``slipstream run`` flags use
it, so a flat spelling and a nested one reach the same field.

Values come from three layers, the later winning (:func:`resolve`):

1. built-in defaults (the dataclass fields below);
2. what the script passes to :func:`slipstream.accelerate` (keywords, or a whole
   ``config=``);
3. ``SLIPSTREAM_*`` variables, which ``slipstream run``'s flags, run config and a
   job spec set: the command line says what this run is. Rank 0 names each
   value of the script they replace (``run_dir`` aside: :data:`SCRIPT_KEEPS`).
   (:meth:`TrainConfig.from_env` is the launcher's order for checking its flags.)

Example::

    cfg = TrainConfig(precision="bf16", accumulate_steps=4)       # flat keywords
    cfg.numerics.precision                                        # "bf16"
    TrainConfig(numerics=NumericsConfig(precision="bf16"))        # the same, nested
    TrainConfig(accumulate_steps=0)   # ConfigError: accumulate_steps must be >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping

from . import sync as _sync  # torch-free: the strategies' names and descriptions
from .errors import ConfigError, did_you_mean
from .settings import check_bounds, setting

PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINT_VERIFY_MODES = ("full", "size", "off")  # see slipstream.checkpoint.verify
PP_SCHEDULES = ("gpipe", "1f1b")
TRACKERS = ("tensorboard", "wandb", "mlflow")
"""Experiment trackers ``log_to`` may name (see slipstream.metrics)."""
ZERO_STAGES = (2, 3)
DEGREES = ("pp", "dp_replicate", "dp_shard", "tp")
"""Parallel degrees, in the order of the device mesh's dimensions (outermost first)."""
ENV_PREFIX = "SLIPSTREAM_"
# Each setting is declared once, here (slipstream.settings.setting): its default, its bounds (checked
# by check_bounds, and taken by the job spec's keys that feed it) and field metadata read by ``slipstream
# run`` (launch/cli.py), which makes one flag per flat name: "choices" (shown in --help; a tuple field
# takes a comma-separated subset), "metavar", and "help" (default: the first sentence of the field's
# docstring). Values are still checked here.


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True)
class SyncConfig:
    """Gradient synchronisation of the data-parallel (DDP) layout."""

    strategy: str = field(default="allreduce", metadata={"metavar": "NAME", "help": f"gradient sync strategy ({_sync.strategies_help()})"})
    """Strategy name (see ``slipstream.sync.available()``). Flat name: ``sync``."""
    options: dict = field(default_factory=dict, metadata={"metavar": "JSON", "help": 'strategy options as JSON, e.g. \'{"rank": 4}\''})
    """Options for the strategy (e.g. {"rank": 4} for powersgd, {"density": 0.01} for topk;
    docs/sync.md lists them). Flat name ``sync_options``; from the environment as JSON."""
    bucket_cap_mb: float = setting(25.0, minimum=0, exclusive_minimum=True, metavar="MB")
    """DDP bucket size in MiB: gradients are fused into buckets of this size and
    each bucket is reduced as soon as its gradients are ready (overlap with backward)."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into the communication buckets: no extra copy."""
    find_unused_parameters: bool = False
    """DDP searches the autograd graph for parameters that got no gradient (slower; for models with unused branches)."""
    static_graph: bool = False
    """DDP may assume the set of used parameters and the graph are the same every step."""

    FLAT: ClassVar[dict[str, str]] = {
        "strategy": "sync",
        "options": "sync_options",
        "bucket_cap_mb": "bucket_cap_mb",
        "gradient_as_bucket_view": "gradient_as_bucket_view",
        "find_unused_parameters": "find_unused_parameters",
        "static_graph": "static_graph",
    }

    def __post_init__(self) -> None:
        _require(isinstance(self.strategy, str) and self.strategy != "", f"sync must be a strategy name, got {self.strategy!r}")
        known = _sync.available()
        _require(self.strategy in known, f"sync must be one of {', '.join(known)}, got {self.strategy!r}"
                 + did_you_mean(self.strategy, known, quote=True))
        check_bounds(self, self.FLAT)
        _require(isinstance(self.options, dict), f"sync_options must be a dict, got {self.options!r}")


@dataclass(frozen=True)
class NumericsConfig:
    """Precision, gradient accumulation and clipping: how one optimizer step is computed."""

    precision: str = field(default="fp32", metadata={"choices": PRECISIONS})
    """fp32, bf16 (autocast) or fp16 (autocast + dynamic gradient scaler)."""
    accumulate_steps: int = setting(1, minimum=1)
    """Micro-steps per optimizer step; gradients synchronise on the last one only."""
    grad_clip_norm: float | None = setting(None, minimum=0, exclusive_minimum=True)
    """Clip the global gradient 2-norm to this value (None: no clipping)."""

    FLAT: ClassVar[dict[str, str]] = {
        "precision": "precision",
        "accumulate_steps": "accumulate_steps",
        "grad_clip_norm": "grad_clip_norm",
    }

    def __post_init__(self) -> None:
        _require(self.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        check_bounds(self, self.FLAT)


@dataclass(frozen=True)
class ParallelConfig:
    """The parallel layout (see docs/parallel.md) and activation checkpointing."""

    dp_replicate: int = setting(-1, minimum=-1, excluded=(0,))  # checked below, with what -1 means
    """Replicated data parallel degree (DDP, or HSDP's replica dimension with dp_shard).
    -1: the rest of the world once the other degrees are divided out, so a run
    that sets nothing is plain DDP over every rank."""
    dp_shard: int = setting(1, minimum=-1, excluded=(0,))
    """Sharded data parallel degree: FSDP2 (``fully_shard``) over this many ranks;
    -1: the rest of the world (dp_replicate, unless given, is then 1)."""
    tp: int = setting(1, minimum=1)
    """Tensor parallel degree (DTensor column/row-wise sharding of the model's plan)."""
    pp: int = setting(1, minimum=1)
    """Pipeline parallel degree (stages of ``torch.distributed.pipelining``)."""
    pp_schedule: str = field(default="1f1b", metadata={"choices": PP_SCHEDULES})
    """Pipeline schedule: gpipe (all forwards, then all backwards) or 1f1b."""
    pp_microbatches: int | None = setting(None, minimum=1)
    """Micro-batches per pipeline step (must divide the batch); None: pp."""
    zero_stage: int = field(default=3, metadata={"choices": ZERO_STAGES})
    """With dp_shard > 1: 3 reshards parameters after forward (ZeRO-3: least memory,
    gathers them again in backward); 2 keeps them gathered until backward ends
    (``reshard_after_forward=False``: one all-gather per step instead of two).
    FSDP2 cannot do ZeRO-1 (replicated gradients, sharded optimizer state only)."""
    activation_checkpointing: tuple[str, ...] = field(default=(), metadata={"metavar": "CLASS[,CLASS]"})
    """Class names of modules whose activations are recomputed in backward."""

    FLAT: ClassVar[dict[str, str]] = {
        "dp_replicate": "dp_replicate",
        "dp_shard": "dp_shard",
        "tp": "tp",
        "pp": "pp",
        "pp_schedule": "pp_schedule",
        "pp_microbatches": "pp_microbatches",
        "zero_stage": "zero_stage",
        "activation_checkpointing": "activation_checkpointing",
    }

    def __post_init__(self) -> None:
        for name in DEGREES:
            value = getattr(self, name)
            _require(
                isinstance(value, int) and not isinstance(value, bool) and (value >= 1 or value == -1),
                f"{name} must be >= 1 (or -1: the rest of the world), got {value!r}",
            )
        _require(self.tp != -1 and self.pp != -1, f"only dp_replicate or dp_shard may be -1, got tp({self.tp}) pp({self.pp})")
        _require(self.pp_schedule in PP_SCHEDULES, f"pp_schedule must be one of {', '.join(PP_SCHEDULES)}, got {self.pp_schedule!r}")
        check_bounds(self, self.FLAT)  # the degrees again (they pass by now), and pp_microbatches
        if self.pp_microbatches is not None and self.pp_schedule == "1f1b" and self.pp > 1:
            _require(
                self.pp_microbatches >= self.pp,
                f"pp_microbatches({self.pp_microbatches}) must be >= pp({self.pp}) for the 1f1b schedule",
            )
        if self.zero_stage == 1:
            raise ConfigError(
                "zero_stage 1 (sharded optimizer state only) is not available: FSDP2 shards parameters, "
                "gradients and optimizer state together; use zero_stage 2 or 3"
            )
        _require(self.zero_stage in ZERO_STAGES, f"zero_stage must be 2 or 3, got {self.zero_stage!r}")
        names = self.activation_checkpointing
        object.__setattr__(self, "activation_checkpointing", _split_names(names) if isinstance(names, str) else tuple(names))
        bad = [n for n in self.activation_checkpointing if not all(p.isidentifier() for p in str(n).split("."))]
        _require(not bad, f"activation_checkpointing must name module classes (such as Block), got {', '.join(map(repr, bad))}")

    @property
    def is_mesh(self) -> bool:
        """True when some degree asks for a device mesh (sharding, TP or PP) rather than plain DDP."""
        return self.dp_shard != 1 or self.tp > 1 or self.pp > 1


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoints and preemption (see docs/fault-tolerance.md)."""

    dir: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Where checkpoints go; when set, the run resumes from the newest complete one."""
    every_steps: int | None = setting(None, minimum=1)
    """Save every this many optimizer steps (None: only on preemption and at the end)."""
    every_s: float | None = setting(None, minimum=0, exclusive_minimum=True)
    """Save when this many seconds passed since the last save (the ranks agree on the clock about
    once a second, not every step, so such a save can come up to a second and a step late)."""
    keep_last: int = setting(3, minimum=1)
    """Complete checkpoints kept; older ones are deleted."""
    async_save: bool = False
    """Stage to CPU memory and write in a background thread (the loop blocks only for staging)."""
    verify: str = field(default="full", metadata={"choices": CHECKPOINT_VERIFY_MODES})
    """Check before loading: full (sizes and CRC-32 of every file), size (sizes only), off.
    A checkpoint that fails is moved aside and the previous one is loaded."""
    max_failures: int = setting(3, minimum=1)
    """Saves that may fail in a row (full disk, ...) before the run exits 1; each failure
    before that is reported and training continues."""
    preemption_deadline_s: float = setting(25.0, minimum=0, exclusive_minimum=True)
    """After SIGTERM: an emergency checkpoint at the next step, then exit 143; past this
    deadline the process exits 143 regardless (keep it under the pod's grace period)."""
    snapshot_every_steps: int | None = setting(None, minimum=1)
    """Also keep each rank's state of every Nth step in host memory (/dev/shm): a worker the agent
    restarts resumes from there when it is newer than the newest checkpoint on disk, so a failure
    redoes at most N steps (None: disk checkpoints only)."""
    snapshot_peer_copy: bool = True
    """With snapshot_every_steps and more than one node: also copy each rank's snapshot to a rank
    on another node (in the background), so a node lost with its memory resumes from there, not
    from disk. Doubles the snapshots' host memory; off: a lost node's ranks go back to disk."""

    FLAT: ClassVar[dict[str, str]] = {
        "dir": "checkpoint_dir",
        "every_steps": "checkpoint_every_steps",
        "every_s": "checkpoint_every_s",
        "keep_last": "checkpoint_keep_last",
        "async_save": "checkpoint_async",
        "verify": "checkpoint_verify",
        "max_failures": "checkpoint_max_failures",
        "preemption_deadline_s": "preemption_deadline_s",
        "snapshot_every_steps": "snapshot_every_steps",
        "snapshot_peer_copy": "snapshot_peer_copy",
    }

    def __post_init__(self) -> None:
        _require(self.dir is None or self.dir != "", "checkpoint_dir must be a path or None, got ''")
        check_bounds(self, self.FLAT)
        _require(
            self.verify in CHECKPOINT_VERIFY_MODES,
            f"checkpoint_verify must be one of {', '.join(CHECKPOINT_VERIFY_MODES)}, got {self.verify!r}",
        )


@dataclass(frozen=True)
class MetricsConfig:
    """What is measured and where it goes (see docs/metrics.md)."""

    profile: bool = True
    """Time each step's phases (data wait, forward, backward, exposed communication,
    optimizer, checkpoint) and compare ranks at log steps to name stragglers."""
    timeline: bool = False
    """Write compute/communication spans per rank as a Chrome trace (RUN_DIR/timeline/)."""
    tensorboard: bool = False
    """Write every metric to TensorBoard event files (RUN_DIR/tensorboard/rank<R>)."""
    prometheus_port: int | None = setting(None, minimum=0, maximum=65535, metavar="PORT")
    """Serve Prometheus metrics; rank R listens on this port + local rank (0: any free port)."""
    prometheus_addr: str = field(default="127.0.0.1", metadata={"metavar": "ADDR"})
    """Address the Prometheus endpoint binds to (0.0.0.0 to let a cluster scrape it)."""
    flops_per_sample: float | None = setting(None, minimum=0, exclusive_minimum=True)
    """Training FLOPs (forward + backward) of one sample, for MFU; None: 6 * params * tokens
    when the model takes token ids, else no MFU."""
    peak_flops: float | None = setting(None, minimum=0, exclusive_minimum=True)
    """Peak FLOP/s of one device, for MFU; None: a table of known GPUs (none on CPU)."""
    straggler_threshold: float = setting(0.1, minimum=0, exclusive_minimum=True)
    """Name a straggler only when its compute per step exceeds the median rank's by more
    than this fraction (and by more than 2 ms), in each of the last 3 log steps in a row."""
    log_to: tuple[str, ...] = field(default=(), metadata={"choices": TRACKERS})
    """Experiment trackers that receive every metric: tensorboard, wandb, mlflow (comma-separated
    from the environment or ``--log-to``). Each needs its package (the extra of the same name: docs/install.md)."""

    FLAT: ClassVar[dict[str, str]] = {
        "profile": "profile",
        "timeline": "timeline",
        "tensorboard": "tensorboard",
        "prometheus_port": "prometheus_port",
        "prometheus_addr": "prometheus_addr",
        "flops_per_sample": "flops_per_sample",
        "peak_flops": "peak_flops",
        "straggler_threshold": "straggler_threshold",
        "log_to": "log_to",
    }

    def __post_init__(self) -> None:
        check_bounds(self, self.FLAT)
        _require(self.prometheus_addr != "", "prometheus_addr must be an address, got ''")
        names = _split_names(self.log_to) if isinstance(self.log_to, str) else tuple(self.log_to)
        unknown = [name for name in names if name not in TRACKERS]
        _require(not unknown, f"log_to must name trackers among {', '.join(TRACKERS)}, got {', '.join(unknown)}")
        object.__setattr__(self, "log_to", names)


@dataclass(frozen=True)
class RunConfig:
    """Bookkeeping of the run: where artefacts go, how often the host reads figures back."""

    dir: str | None = field(default=None, metadata={"metavar": "DIR"})
    """Where per-rank metrics (JSONL) and run artefacts go; None: runs/<timestamp>. Flat name: ``run_dir``."""
    log_every_steps: int = setting(10, minimum=1)
    """Loss is read back to the host (one sync) only every this many steps."""
    progress: bool = True
    """Show a progress bar on rank 0 when the console is a terminal."""
    total_steps: int | None = setting(None, minimum=0)
    """Known length of the run, for the progress bar and ETA."""

    FLAT: ClassVar[dict[str, str]] = {
        "dir": "run_dir",
        "log_every_steps": "log_every_steps",
        "progress": "progress",
        "total_steps": "total_steps",
    }

    def __post_init__(self) -> None:
        check_bounds(self, self.FLAT)


SECTIONS: dict[str, type] = {
    "sync": SyncConfig,
    "numerics": NumericsConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "metrics": MetricsConfig,
    "run": RunConfig,
}
"""TrainConfig's sections, by attribute name."""

FLAT_NAMES: dict[str, tuple[str, str]] = {
    flat: (section, leaf) for section, cls in SECTIONS.items() for leaf, flat in cls.FLAT.items()
}
"""Flat name (keyword, ``SLIPSTREAM_*`` variable, flag) -> (section, field)."""


def _flat_fields() -> dict[str, dataclasses.Field]:
    """The dataclass field behind each flat name (type, default, docstring source)."""
    by_section = {name: {f.name: f for f in fields(cls)} for name, cls in SECTIONS.items()}
    return {flat: by_section[section][leaf] for flat, (section, leaf) in FLAT_NAMES.items()}


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@dataclass(frozen=True, init=False)
class TrainConfig:
    """How :func:`slipstream.accelerate` wraps a model and optimizer: one section per component.

    Build it nested (``TrainConfig(numerics=NumericsConfig(precision="bf16"))``)
    or with flat keywords (``TrainConfig(precision="bf16")``); the two may be
    mixed, a flat keyword overriding the section's field. Every flat name can
    also come from ``SLIPSTREAM_<FLAT_NAME>`` (see :meth:`from_env`).
    """

    sync: SyncConfig
    numerics: NumericsConfig
    parallel: ParallelConfig
    checkpoint: CheckpointConfig
    metrics: MetricsConfig
    run: RunConfig

    def __init__(
        self,
        *,
        sync: SyncConfig | str | None = None,
        numerics: NumericsConfig | None = None,
        parallel: ParallelConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
        metrics: MetricsConfig | None = None,
        run: RunConfig | None = None,
        **flat: Any,
    ) -> None:
        if isinstance(sync, str):  # the flat keyword ``sync`` names the strategy
            flat["sync"] = sync
            sync = None
        given = {"sync": sync, "numerics": numerics, "parallel": parallel, "checkpoint": checkpoint, "metrics": metrics, "run": run}
        unknown = sorted(set(flat) - set(FLAT_NAMES))
        if unknown:
            raise ConfigError(_unknown_message(unknown))
        per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for name, value in flat.items():
            section, leaf = FLAT_NAMES[name]
            per_section[section][leaf] = value
        for name, cls in SECTIONS.items():
            base = given[name]
            if base is not None and not isinstance(base, cls):
                raise ConfigError(f"{name} must be a {cls.__name__}, got {type(base).__name__}")
            if base is None:
                value = cls(**per_section[name])
            elif per_section[name]:
                value = dataclasses.replace(base, **per_section[name])
            else:
                value = base
            object.__setattr__(self, name, value)
        self._check_across_sections()

    def _check_across_sections(self) -> None:
        # Checked here, not only in accelerate(), so `slipstream run` refuses it before any worker starts.
        if self.parallel.is_mesh:
            p = self.parallel
            strategy = _sync.describe(self.sync.strategy)
            if strategy.on_sharded_replicas:  # a dp_shard group is one replica (FSDP2 inside), joined over dp_replicate
                beyond = " and ".join(f"{n}({getattr(p, n)})" for n in ("tp", "pp") if getattr(p, n) > 1)
                _require(
                    not beyond,
                    f"sync {strategy.name!r} with {beyond} is not supported: {strategy.name} runs on DDP replicas or "
                    "on dp_shard replicas (FSDP2 inside each, the outer step across dp_replicate); use tp 1 and pp 1, "
                    "or sync allreduce",
                )
            else:
                _require(
                    strategy.kind is _sync.SyncKind.REDUCER and not self.sync.options,
                    f"sync {self.sync.strategy!r} is a DDP gradient hook; with dp_shard, tp or pp, FSDP2 reduces the "
                    "gradients (leave sync at allreduce)",
                )
            _require(self.numerics.precision != "fp16", "precision fp16 is not supported with dp_shard, tp or pp; use bf16")
        if self.parallel.pp > 1 and self.numerics.accumulate_steps > 1:
            raise ConfigError(
                f"accumulate_steps({self.numerics.accumulate_steps}) with pp({self.parallel.pp}): use pp_microbatches "
                "instead (the pipeline already accumulates over its micro-batches)"
            )
        from .sync.options import check_sync_options  # the options' names and values, before any worker starts

        check_sync_options(self.sync.strategy, self.sync.options)

    def degrees(self, world_size: int) -> dict[str, int]:
        """The four degrees with -1 resolved against ``world_size``, checked to multiply to it.

        Example::

            TrainConfig(tp=2).degrees(8)   # {"pp": 1, "dp_replicate": 4, "dp_shard": 1, "tp": 2}
            TrainConfig(dp_replicate=2, tp=3).degrees(4)
            # ConfigError: dp_replicate(2) * dp_shard(1) * tp(3) * pp(1) != world_size(4)
        """
        values = {name: getattr(self.parallel, name) for name in DEGREES}
        if values["dp_shard"] == -1 and values["dp_replicate"] == -1:
            values["dp_replicate"] = 1  # dp_shard=-1 alone: every data-parallel rank shards
        rest = [name for name, value in values.items() if value == -1]
        known = 1
        for name, value in values.items():
            if value != -1:
                known *= value
        if rest:
            others = " * ".join(f"{n}({values[n]})" for n in ("dp_replicate", "dp_shard", "tp", "pp") if n != rest[0])
            if world_size % known:
                raise ConfigError(f"world_size({world_size}) is not divisible by {others} = {known}, so {rest[0]}=-1 has no value")
            values[rest[0]] = world_size // known
        product = values["dp_replicate"] * values["dp_shard"] * values["tp"] * values["pp"]
        if product != world_size:
            raise ConfigError(
                f"dp_replicate({values['dp_replicate']}) * dp_shard({values['dp_shard']}) * tp({values['tp']}) "
                f"* pp({values['pp']}) != world_size({world_size})"
            )
        return values

    def is_plain_data_parallel(self, world_size: int) -> bool:
        """True when the layout is DDP over every rank (the default): no sharding, TP or PP."""
        d = self.degrees(world_size)
        return d["dp_shard"] == 1 and d["tp"] == 1 and d["pp"] == 1

    def flat(self) -> dict[str, Any]:
        """Every leaf by its flat name.

        Example::

            TrainConfig(precision="bf16").flat()["precision"]   # "bf16"
        """
        return {flat: getattr(getattr(self, section), leaf) for flat, (section, leaf) in FLAT_NAMES.items()}

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed, by flat name or whole section (validated again).

        Example::

            TrainConfig().replace(precision="bf16", checkpoint_dir="/ckpt")
        """
        sections = {name: changes.pop(name) for name in list(changes) if name in SECTIONS and not isinstance(changes[name], str)}
        current = {name: getattr(self, name) for name in SECTIONS}
        current.update(sections)
        if isinstance(changes.get("sync"), str):  # the flat name of the strategy, not the section
            current["sync"] = dataclasses.replace(current["sync"], strategy=changes.pop("sync"))
        return TrainConfig(**current, **changes)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "TrainConfig":
        """Built-in defaults, then ``SLIPSTREAM_*`` variables, then flat ``overrides``.

        Example::

            os.environ["SLIPSTREAM_PRECISION"] = "bf16"
            TrainConfig.from_env(accumulate_steps=2).numerics.precision  # "bf16"
        """
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, f in _flat_fields().items():
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                values[name] = _parse_env(name, f, raw)
        unknown = sorted(set(overrides) - set(FLAT_NAMES))
        if unknown:
            raise ConfigError(_unknown_message(unknown))
        values.update(overrides)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The ``SLIPSTREAM_*`` variables that reproduce the non-default fields."""
        out = {}
        defaults = _flat_fields()
        for name, value in self.flat().items():
            default = _default(defaults[name])
            if isinstance(default, tuple):
                default = tuple(default)
            if value != default:
                out[ENV_PREFIX + name.upper()] = env_text(value)
        return out


def env_text(value: Any) -> str:
    """A field's value as its ``SLIPSTREAM_*`` variable holds it (what :meth:`TrainConfig.from_env`
    reads back): lists comma-separated, ``sync_options`` as JSON.

    Example::

        env_text(("Block", "MLP"))   # "Block,MLP"
        env_text({"rank": 4})        # '{"rank": 4}'
    """
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def options_in_env(environ: Mapping[str, str]) -> list[str]:
    """The flat names of the training options set in ``environ`` (``SLIPSTREAM_<NAME>``, not empty),
    in TrainConfig's order, the run directory aside: ``slipstream run`` always sets it, so it
    says nothing about whether the user asked for a training option.

    Example::

        options_in_env({"SLIPSTREAM_SYNC": "bf16", "SLIPSTREAM_RUN_DIR": "runs/x"})   # ["sync"]
    """
    return [name for name in FLAT_NAMES if name != "run_dir" and environ.get(ENV_PREFIX + name.upper(), "") != ""]


SCRIPT_KEEPS = frozenset({"run_dir"})
"""The exception to :func:`resolve`'s rule: ``slipstream run`` sets ``SLIPSTREAM_RUN_DIR`` for every run
(its own choice without ``--run-dir``), so a script that names its run directories keeps them."""


@dataclass(frozen=True)
class Override:
    """A value the script gave that differs from a ``SLIPSTREAM_*`` variable (see :func:`resolve`):
    replaced by the variable's, or, for :data:`SCRIPT_KEEPS`, kept."""

    name: str
    """The flat name (``checkpoint_dir``)."""
    script_value: Any
    env_value: Any

    @property
    def used_value(self) -> Any:
        """The value the run uses."""
        return self.script_value if self.name in SCRIPT_KEEPS else self.env_value

    def line(self) -> str:
        """What rank 0 prints, naming the flag and the variable (``[slipstream] --checkpoint-dir /shared/ckpt
        (SLIPSTREAM_CHECKPOINT_DIR, ...) overrides the script's checkpoint_dir='ckpt'``)."""
        flag, variable = "--" + self.name.replace("_", "-"), ENV_PREFIX + self.name.upper()
        if self.name in SCRIPT_KEEPS:
            return (f"[slipstream] the script's {self.name}={self.script_value!r} is used; {variable} "
                    f"{env_text(self.env_value)} (slipstream run's {flag}, or the directory it chose) keeps the "
                    "launcher's own files (hang reports) only")
        return (f"[slipstream] {flag} {env_text(self.env_value)} ({variable}, from slipstream run's "
                f"flags, run config or job spec, or the environment) overrides the script's "
                f"{self.name}={self.script_value!r}")


def resolve(script: "TrainConfig | Mapping[str, Any]", environ: Mapping[str, str] | None = None
            ) -> tuple[TrainConfig, list[Override]]:
    """The configuration a worker runs with: the script's values, then the ``SLIPSTREAM_*``
    variables over them (``run_dir`` aside: :data:`SCRIPT_KEEPS`); and every value of the
    script a variable disagreed with (:class:`Override`, one line each).

    ``script``: the keywords given to :func:`slipstream.accelerate` (None counts as not given), or
    a whole :class:`TrainConfig` (its fields that differ from the defaults count as given). Why the
    environment wins: ``slipstream run``'s flags, run config and a job spec are written for this
    run and reach the workers only as these variables; the script's value is its default.

    Example::

        cfg, over = resolve({"checkpoint_dir": "ckpt"}, {"SLIPSTREAM_CHECKPOINT_DIR": "/shared/ckpt"})
        cfg.checkpoint.dir                 # "/shared/ckpt"
        [o.name for o in over]             # ["checkpoint_dir"]
    """
    environ = os.environ if environ is None else environ
    fields_by_name = _flat_fields()
    from_env = {name: _parse_env(name, f, environ[ENV_PREFIX + name.upper()])
                for name, f in fields_by_name.items() if environ.get(ENV_PREFIX + name.upper(), "") != ""}
    if isinstance(script, TrainConfig):
        given = {name: value for name, value in script.flat().items()
                 if _normal(name, value) != _normal(name, _default(fields_by_name[name]))}
    else:
        given = {name: value for name, value in script.items() if value is not None}
        unknown = sorted(set(given) - set(FLAT_NAMES))
        if unknown:
            raise ConfigError(_unknown_message(unknown))
    applied = {name: value for name, value in from_env.items() if not (name in SCRIPT_KEEPS and name in given)}
    if isinstance(script, TrainConfig):
        config = script.replace(**applied) if applied else script
    else:
        config = TrainConfig(**{**given, **applied})
    overrides = [Override(name, given[name], from_env[name]) for name in given
                 if name in from_env and _normal(name, given[name]) != _normal(name, from_env[name])]
    return config, overrides


def replaced(lower: Mapping[str, Any], higher: Mapping[str, Any]) -> list[str]:
    """The flat names both layers give, with different values (``slipstream run`` names them when its
    flags replace a run config's, or a job spec's), e.g. ``["precision"]``."""
    return [name for name in FLAT_NAMES
            if name in lower and name in higher and _normal(name, lower[name]) != _normal(name, higher[name])]


def _normal(name: str, value: Any) -> Any:
    """A value as its field holds it (``"Block,MLP"`` and ``("Block", "MLP")`` for a tuple field)."""
    if str(_flat_fields()[name].type).startswith("tuple"):
        return _split_names(value) if isinstance(value, str) else tuple(value)
    return value


PARAMETER_DTYPES = ("fp32", "bf16", "fp16")
"""Dtypes a model's parameters may be in when handed to accelerate()."""


def check_parameter_dtype(config: TrainConfig, dtype: str) -> None:
    """Refuse a parameter dtype the config cannot train, before anything is built.

    ``dtype`` names the model's parameter dtype (fp32, bf16, fp16). Pure: accelerate()
    calls it first, and the conformance matrix (tests/conformance) calls it in-process.

    Example::

        check_parameter_dtype(TrainConfig(precision="bf16"), "bf16")   # accepted
    """
    _require(dtype in PARAMETER_DTYPES, f"parameter dtype must be one of {', '.join(PARAMETER_DTYPES)}, got {dtype!r}")
    precision = config.numerics.precision
    # Both found by the conformance matrix (tests/conformance): fp16 parameters train to NaN by the
    # second step with fp32 numerics (AdamW's eps=1e-8 is 0 in fp16), torch's GradScaler refuses
    # their fp16 gradients under precision fp16, and bf16 autocast over them mixes dtypes in LayerNorm.
    _require(
        dtype != "fp16",
        f"parameter dtype fp16 with precision {precision} is not supported: pure fp16 weights need fp32 master "
        "weights and a loss scaler (GradScaler refuses fp16 gradients); keep fp32 parameters with precision fp16, "
        "or use bf16 parameters",
    )
    _require(
        not (dtype == "bf16" and precision == "fp16"),
        "parameter dtype bf16 with precision fp16 is not supported: autocast to fp16 over bf16 weights mixes two "
        "16-bit formats; use precision bf16 (or fp32) with bf16 parameters, or fp32 parameters with precision fp16",
    )


def _unknown_message(unknown: list[str]) -> str:
    import difflib

    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, list(FLAT_NAMES), n=1)
        hints.append(f"{name} (did you mean {close[0]}?)" if close else name)
    return f"unknown training option(s): {', '.join(hints)}; known: {', '.join(FLAT_NAMES)}"


def _split_names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _parse_env(flat_name: str, f: dataclasses.Field, raw: str) -> Any:
    name = ENV_PREFIX + flat_name.upper()
    kind = str(f.type)
    if raw.strip().lower() == "none" and "None" in kind:
        return None
    try:
        if kind.startswith("bool"):
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
        if kind.startswith("tuple"):
            return _split_names(raw)
        if kind.startswith("dict"):
            value = json.loads(raw)
            if not isinstance(value, dict):
                raise ValueError
            return value
    except ValueError:  # json.JSONDecodeError is a ValueError too
        raise ConfigError(f"{name} must be a {kind.split(' ')[0]}, got {raw!r}") from None
    return raw


__all__ = [
    "CHECKPOINT_VERIFY_MODES",
    "DEGREES",
    "FLAT_NAMES",
    "PP_SCHEDULES",
    "PRECISIONS",
    "SECTIONS",
    "TRACKERS",
    "CheckpointConfig",
    "MetricsConfig",
    "NumericsConfig",
    "Override",
    "SCRIPT_KEEPS",
    "ParallelConfig",
    "RunConfig",
    "SyncConfig",
    "TrainConfig",
    "replaced",
    "resolve",
]
