"""Enumerate layouts, predict each, keep what fits in memory, rank by time to train and cost.

Axes: tensor parallel (transformers; within a node), pipeline (transformers; 1F1B and GPipe),
data parallel as DDP (with every sync strategy that applies), FSDP (ZeRO-3 and ZeRO-2) or
HSDP (shard within a node, replicate across), micro-batch (powers of two dividing the
per-rank batch), accumulation (the rest of the per-rank batch) and activation checkpointing.
The global batch is fixed (``global_batch``), so every layout trains on the same samples.

Example::

    result = plan("gpt-7b", gpus=8, gpu_type="H100", network="400gbit-ib", tokens=1e9)
    result.best.layout.label(), result.best.time_to_train_s
    print(result.table())
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from .. import sync
from ..errors import ConfigError
from .costmodel import FRAMEWORKS, Layout, Prediction
from .network import Network, parse_network
from .published import Uncertainty, uncertainty
from .rates import calibrated, predict_layout
from .specs import GIB, GpuSpec, ModelSpec, get_gpu, get_model

MAX_MICRO_BATCH = 512


@dataclass
class Candidate:
    prediction: Prediction
    time_to_train_s: float
    cost: float

    @property
    def layout(self) -> Layout:
        return self.prediction.layout


@dataclass
class PlanResult:
    model: ModelSpec
    gpu: GpuSpec
    network: Network
    gpus: int
    gpus_per_node: int
    global_batch: int
    total_samples: float
    price_per_gpu_hour: float
    candidates: list[Candidate]  # fitting, best first
    rejected_memory: int = 0
    smallest_rejected_bytes: float | None = None
    notes: list[str] = field(default_factory=list)
    uncertainty: Uncertainty = field(default_factory=Uncertainty)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.gpus / self.gpus_per_node))

    def table(self, top: int = 10, width: int | None = None):
        """A rich Table of the ``top`` candidates; with ``width`` (the terminal's columns), the
        least telling columns are left out until it fits, and the caption names them. No cell
        is cut: a layout name is what you pick by."""
        from rich.table import Table

        t = Table(title=(f"{self.model.name} on {self.gpus} x {self.gpu.name} ({self.nodes} node(s) of "
                         f"{self.gpus_per_node}), {self.network.spec}, global batch {self.global_batch}, "
                         f"{self.total_samples:.3g} samples"))
        columns = (("#", "right"), ("layout", "left"), ("sync", "left"), ("micro x acc", "right"),
                   ("ckpt", "left"), ("step", "right"), ("exposed comm", "right"), ("bubble", "right"),
                   ("time to train", "right"), ("cost", "right"), ("mem/GPU", "right"), ("scaling eff", "right"))
        rows = []
        for i, c in enumerate(self.candidates[:top], 1):
            p, L = c.prediction, c.layout
            mb = f"{L.micro_batch} x {L.microbatches_per_step}"
            u = self.uncertainty
            lo, hi = u.step_range(p.step_s, p.scaling_efficiency)
            spread = (hi - lo) / 2 / p.step_s
            eff = (f"{p.scaling_efficiency:.0%} ±{u.eff_pts:.0f}" if u.eff_pts else
                   f"{p.scaling_efficiency:.0%}" if not u.step_rel else f"{p.scaling_efficiency:.0%} ±{spread:.0%}")
            rows.append((str(i), L.label(), L.sync if L.dp_shard == 1 and L.dp_replicate > 1 else "-", mb,
                         "yes" if L.activation_checkpointing else "no", f"{fmt_s(p.step_s)} ±{spread:.0%}",
                         fmt_s(p.exposed_comm_s), fmt_s(p.bubble_s), fmt_s(c.time_to_train_s), f"${c.cost:,.0f}",
                         f"{p.memory_bytes / GIB:.1f}/{p.memory_limit_bytes / GIB:.0f} GiB", eff))
        keep, hidden = fit_columns([name for name, _ in columns], rows, width,
                                   ("bubble", "exposed comm", "ckpt", "sync", "scaling eff", "cost", "micro x acc",
                                    "time to train", "mem/GPU"),
                                   identity=("layout", "sync", "micro x acc", "ckpt"))
        for j in keep:
            t.add_column(columns[j][0], justify=columns[j][1], no_wrap=True)
        for r in rows:
            t.add_row(*(r[j] for j in keep))
        captions = []
        if hidden:
            captions.append(f"not shown at {width} columns: {', '.join(hidden)} (--json has every figure)")
        if self.uncertainty.source:
            captions.append(f"±: {self.uncertainty.source}")
        if captions:
            t.caption = "\n".join(captions)
        return t


def fit_columns(names: list[str], rows: list[tuple[str, ...]], width: int | None,
                drop_order: tuple[str, ...], identity: tuple[str, ...] = ()) -> tuple[list[int], list[str]]:
    """Which columns of a rich table fit in ``width`` terminal columns: the indices kept, and the
    names left out, taken in ``drop_order`` until the rest fits (no cell is ever cut). Each
    column takes its widest text, one space either side and a border; the first border too.

    ``identity``: the columns that say which candidate a row is (layout, sync, ...). One of them
    is kept, and the next in ``drop_order`` dropped instead, where the rows would otherwise
    show fewer different candidates: at 120 columns the sync column went and ``ddp16`` rows
    with powersgd and bf16 looked the same.

    >>> fit_columns(["a", "bb"], [("xxxx", "yy")], 10, ("bb",))
    ([0], ['bb'])
    >>> fit_columns(["a", "bb", "c"], [("x", "1", "p"), ("x", "2", "q")], 10, ("bb", "c"), identity=("a", "bb"))
    ([0, 1], ['c'])
    """
    keep = list(range(len(names)))
    hidden: list[str] = []
    if width is None:
        return keep, hidden
    natural = [max([len(name)] + [len(r[j]) for r in rows]) for j, name in enumerate(names)]

    def candidates_told_apart(columns: list[int]) -> int:
        return len({tuple(r[j] for j in columns if names[j] in identity) for r in rows})

    for name in drop_order:
        if sum(natural[j] + 3 for j in keep) + 1 <= width:
            break
        j = names.index(name)
        rest = [k for k in keep if k != j]
        if name in identity and candidates_told_apart(rest) < candidates_told_apart(keep):
            continue  # the only column telling some rows apart
        keep = rest
        hidden.append(name)
    return keep, hidden


def fmt_s(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} us" if s > 0 else "0"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    if s < 3 * 86400:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def dp_syncs(nodes: int, gpus_per_node: int = 8) -> list[str]:
    """Sync strategies worth trying for DDP; hierarchical ones only across nodes of several GPUs."""
    flat = ["allreduce", "bf16", "powersgd"]  # the codecs worth a row; their two-level forms from the registry
    if nodes > 1 and gpus_per_node > 1:
        infos = [sync.describe(n) for n in sync.available()]
        return flat + [i.name for i in infos if i.levels == 2 and not i.auto and i.codec in flat]
    return flat


@functools.lru_cache(maxsize=4096)
def _train_config_error(items: tuple) -> str | None:
    try:
        from ..config import TrainConfig
    except ImportError:  # pragma: no cover
        return None
    try:
        TrainConfig(**{k: tuple(v) if isinstance(v, list | tuple) else v for k, v in items})
    except (ConfigError, TypeError, ValueError) as exc:
        return str(exc)
    return None


def train_config_error(train: dict) -> str | None:
    """Why slipstream.config.TrainConfig refuses these fields (None: it accepts them). The planner
    only proposes layouts the engine can run (e.g. no fp16 with FSDP/TP/PP: TrainConfig refuses it)."""
    return _train_config_error(tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in train.items())))


def enumerate_layouts(model: ModelSpec, gpus: int, gpus_per_node: int, global_batch: int,
                      precision: str) -> Iterator[Layout]:
    """Every layout of the planner's axes (module docstring) that divides the job evenly."""
    nodes = max(1, math.ceil(gpus / gpus_per_node))
    tps = [1]
    pps = [1]
    if model.kind == "transformer":
        tps = [t for t in _pow2_upto(min(gpus_per_node, model.heads, gpus)) if gpus % t == 0 and model.heads % t == 0]
    for tp in tps:
        if model.kind == "transformer":
            pps = [p for p in _pow2_upto(min(16, model.layers, gpus // tp)) if (gpus // tp) % p == 0]
        for pp in pps:
            dp = gpus // (tp * pp)
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            splits: list[tuple[int, int, int]] = [(dp, 1, 3)]  # (replicate, shard, zero stage)
            if dp > 1:
                splits += [(1, dp, 3), (1, dp, 2)]
                local = gpus_per_node // tp
                if 1 < local < dp and dp % local == 0:
                    splits.append((dp // local, local, 3))
            for rep, shard, zs in splits:
                syncs = dp_syncs(nodes, gpus_per_node) if (shard == 1 and rep > 1) else ["allreduce"]
                for mb in _pow2_upto(min(per_rank, MAX_MICRO_BATCH)):
                    if per_rank % mb:
                        continue
                    k = per_rank // mb
                    # 1F1B needs at least pp micro-batches in flight (TrainConfig refuses fewer)
                    schedules = (["1f1b", "gpipe"] if k >= pp else ["gpipe"]) if pp > 1 else ["1f1b"]
                    for sched in schedules:
                        for ckpt in (False, True):
                            for sync in syncs:
                                yield Layout(
                                    dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, pp_schedule=sched,
                                    pp_microbatches=k if pp > 1 else 1, zero_stage=zs, sync=sync,
                                    micro_batch=mb, accumulate_steps=1 if pp > 1 else k,
                                    activation_checkpointing=ckpt, precision=precision,
                                )


def plan(model: str | ModelSpec, gpus: int, gpu_type: str | GpuSpec, network: str | Network,
         price: float | None = None, samples: float | None = None, tokens: float | None = None,
         global_batch: int | None = None, precision: str | None = None, gpus_per_node: int | None = None,
         framework: str = "ddp") -> PlanResult:
    """Rank every layout of ``model`` on ``gpus`` GPUs; raises ConfigError when none fits.
    ``framework``: how gradients are fused and launched (costmodel.FRAMEWORKS; ``ddp`` is what
    slipstream runs, the others are those of the published record, for comparison)."""
    if framework not in FRAMEWORKS:
        raise ConfigError(f"--framework: must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    m = get_model(model) if isinstance(model, str) else model
    gpu = get_gpu(gpu_type) if isinstance(gpu_type, str) else gpu_type
    net = parse_network(network) if isinstance(network, str) else network
    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"--gpus: must be an integer >= 1, got {gpus!r}")
    g = gpus_per_node or min(gpus, gpu.gpus_per_node)
    if g < 1 or (gpus > g and gpus % g):
        raise ConfigError(f"--gpus: {gpus} GPUs do not make whole nodes of {g} GPUs")
    prec = precision or ("bf16" if gpu.supports("bf16") else "fp16")
    gpu.peak_flops(prec)  # checks the precision
    if samples is not None and tokens is not None:
        raise ConfigError("give --samples or --tokens, not both")
    if tokens is not None:
        if m.kind != "transformer":
            raise ConfigError(f"--tokens: {m.name} does not take tokens; use --samples")
        total = float(tokens) / m.seq_len
    elif samples is not None:
        total = float(samples)
    else:
        total = (300e9 / m.seq_len) if m.kind == "transformer" else 90 * 1.281167e6  # 300B tokens / 90 ImageNet epochs
    if total <= 0:
        raise ConfigError(f"--samples/--tokens: must be > 0, got {total:g}")
    B = global_batch or m.default_global_batch or m.default_batch_per_gpu * gpus
    if B < 1:
        raise ConfigError(f"--global-batch: must be >= 1, got {B}")
    price_h = gpu.price_per_hour if price is None else float(price)
    if price_h < 0:
        raise ConfigError(f"--price: must be >= 0, got {price_h:g}")
    fitting: list[Candidate] = []
    rejected = 0
    smallest = None
    refused = 0
    for L in enumerate_layouts(m, gpus, g, B, prec):
        if train_config_error(L.train_fields()):
            refused += 1
            continue
        p = predict_layout(m, gpu, net, L, g, framework)
        if not p.fits:
            rejected += 1
            smallest = p.memory_bytes if smallest is None else min(smallest, p.memory_bytes)
            continue
        steps = total / L.global_batch
        ttt = steps * p.step_s
        fitting.append(Candidate(p, ttt, ttt / 3600 * gpus * price_h))
    if not fitting:
        if rejected == 0 and refused:
            raise ConfigError(f"no layout of {m.name} on {gpus} GPUs at {prec} is one slipstream can run "
                              f"(e.g. {train_config_error(next(enumerate_layouts(m, gpus, g, B, prec)).train_fields())})")
        if rejected == 0:
            raise ConfigError(f"--global-batch: {B} cannot be split evenly over any layout of {gpus} GPUs")
        raise ConfigError(
            f"no layout of {m.name} fits in {gpu.name} memory ({gpu.memory_bytes / GIB:.0f} GiB): the smallest needs "
            f"{smallest / GIB:.1f} GiB per GPU; use more GPUs or a GPU with more memory")
    fitting.sort(key=lambda c: (c.time_to_train_s, c.cost, c.prediction.memory_bytes))
    result = PlanResult(calibrated(m, gpu, prec), gpu, net, gpus, g, B, total, price_h, fitting, rejected, smallest,
                        uncertainty=uncertainty("cpu" if gpu.name == "CPU" else "gpu"))
    if refused:
        result.notes.append(f"{refused} layouts skipped: slipstream.config.TrainConfig refuses them")
    return result
