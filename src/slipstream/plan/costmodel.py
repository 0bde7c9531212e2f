"""The cost model: step time, memory per device and scaling efficiency of a layout.

Equations (docs/plan.md has them with their assumptions and validation):

* compute: ``t_fwd = F_fwd * b / (tp * pp) / (peak * MFU(b))``, ``t_bwd = 2 t_fwd``
  (+ ``t_fwd`` recomputed with activation checkpointing), ``MFU(b) = mfu * b / (b + b_half)``;
* data-parallel sync (DDP): gradients in buckets (first 1 MiB, then 25 MiB, as DDP), each
  ready when backward has passed its last layer; each bucket goes through its codec
  (``codec.wire_bytes``) on one channel; the step is
  ``t_fwd + max(t_bwd + codec compute, end of the channel) + t_opt`` (:func:`simulate_dp_step`);
* collectives: ring alpha-beta (:mod:`slipstream.network.link`), ``2(n-1) hop + 2(n-1)/n S / bw`` for all-reduce; a group
  spanning nodes gets the node's NIC bandwidth shared by the groups running at once
  (:func:`group_link`); hierarchical = intra reduce-scatter + inter all-reduce of S/g + intra all-gather;
* FSDP (``dp_shard``): per layer all-gather of parameters before forward (and backward for
  ZeRO-3), reduce-scatter of gradients after backward, on one channel overlapping compute
  (:func:`two_queue_schedule`); HSDP adds an all-reduce of each shard over ``dp_replicate``;
* tensor parallel: 2 all-reduces of ``b * s * d`` activations per layer forward and 2 backward,
  not overlapped;
* pipeline: ``(m + pp - 1)`` slots of one micro-batch's stage time (bubble fraction
  ``(pp-1)/(m+pp-1)``), plus a point-to-point activation transfer per slot;
* memory (ZeRO paper, Rajbhandari et al. 2020): parameters, gradients and optimizer states per
  parameter ``2 + 2 + K`` bytes in mixed precision (K = 12 for Adam, 8 for SGD momentum) and
  ``4 + 4 + K'`` in fp32, divided by the shard degree by stage; plus activations (in-flight
  micro-batches, with or without checkpointing), buffers and a fixed overhead.

Example::

    from slipstream.plan.costmodel import Layout, predict
    p = predict(get_model("gpt-1.3b"), get_gpu("A100"), parse_network("100gbit-ib"),
                Layout(dp_replicate=8, micro_batch=4, accumulate_steps=8))
    p.step_s, p.memory_bytes, p.scaling_efficiency
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..network.link import Link, allreduce_steps
from .network import Network
from .specs import GIB, GpuSpec, ModelSpec, layer_matrix

MIB = 1024**2
DDP_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * MIB
MEMORY_OVERHEAD_BYTES = 1.5 * GIB  # CUDA context, allocator caches, NCCL buffers
MEMORY_USABLE_FRACTION = 0.92  # fragmentation
DP_SYNCS = ("allreduce", "bf16", "fp16", "powersgd", "topk", "sign")

# Compute cost of a codec on a GPU: passes over the fp32 gradient (read+write) at HBM speed,
# plus its matmuls. PowerSGD: 7 passes (the cache-blocked implementation) + 4 r numel FLOPs;
# top-k: a selection costs ~ a sort's worth of passes; sign: pack + unpack + residual.
CODEC_PASSES = {"allreduce": 0, "bf16": 2, "fp16": 2, "powersgd": 7, "topk": 16, "sign": 6}


# -- what the published record pointed to (issue #19; docs/plan.md, "The published record") ---------
@dataclass(frozen=True)
class Framework:
    """How a training framework hands gradients to the network: fusion-buffer sizes and the
    background cycle a ready tensor waits for. ``ddp`` is PyTorch DDP (first bucket 1 MiB, then 25
    MiB, launched the moment a bucket is full); ``horovod`` is Horovod as of its 512-GPU benchmark
    (April 2018): a 64 MiB fusion buffer (``tensor_fusion_threshold``, docs/tensor-fusion.md) and a
    background loop that sleeps 5 ms, negotiates the ready tensors and enqueues their fused
    all-reduces on one CUDA stream (horovod/common/operations.cc, ``BackgroundThreadLoop``), read
    in the Horovod repository at its last commit before 2018-04-20."""

    name: str
    first_bucket_bytes: float
    bucket_bytes: float
    cycle_s: float = 0.0
    source: str = ""
    algorithm: str = "ring"  # "ring": 2(n-1) latency steps; "halving-doubling": 2 log2(n) (Thakur et al. 2005)
    hierarchical: bool = False  # reduce inside a node, then across nodes, then broadcast back

    def allreduce_steps(self, n: int) -> int:
        """Latency steps of an all-reduce over ``n`` ranks (the bandwidth term is the same for both).

        >>> FRAMEWORKS["ddp"].allreduce_steps(512), FRAMEWORKS["caffe2-gloo"].allreduce_steps(32)
        (1022, 10)
        """
        if self.algorithm == "halving-doubling" and n > 1:
            return 2 * math.ceil(math.log2(n))
        return allreduce_steps(n)


FRAMEWORKS = {
    "ddp": Framework("ddp", 1 * MIB, 25 * MIB, 0.0, "torch DDP defaults (bucket_cap_mb=25, first bucket 1 MiB)"),
    "horovod": Framework("horovod", 64 * MIB, 64 * MIB, 5e-3,
                         "Horovod, April 2018: 64 MiB fusion buffer, a 5 ms sleep per background cycle"),
    # Goyal et al. 2017, section 4 ("Communication"): each parameter's gradient is all-reduced as soon as
    # backward produced it, in three steps: summed over the 8 GPUs of a server, all-reduced between
    # servers with recursive halving and doubling (Gloo), broadcast back to the 8 GPUs.
    "caffe2-gloo": Framework("caffe2-gloo", 0.0, 0.0, 0.0,
                             "Goyal et al. 2017, section 4 (from memory of the paper, not re-read here)",
                             algorithm="halving-doubling", hierarchical=True),
}

# Stragglers: a synchronous step waits for the slowest of N ranks. With each rank's compute time
# normal with coefficient of variation ``cv``, the step's compute is ``mu (1 + cv E[max of N
# standard normals])`` (the expected maximum, by Blom's approximation; ~sqrt(2 ln N) for large N).
# ``STRAGGLER_CV`` is the one constant of the model fitted to the published record's calibration
# set (published.py, SPLIT, committed before it was fitted); the validation set then checks it.
# The local CPU device (measured in the run it predicts) has no straggler term.
STRAGGLER_CV = 0.017  # published.fit_straggler_cv(): calibration MAE 4.1 pts (0.000-0.080 by 0.001)


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (Blom 1958: ``Phi^-1((n - 0.375) / (n + 0.25))``).

    >>> expected_max_normal(1), round(expected_max_normal(2), 2), round(expected_max_normal(512), 2)
    (0.0, 0.59, 3.03)
    """
    if n <= 1:
        return 0.0
    from statistics import NormalDist

    return NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def straggler_factor(world: int, gpu: GpuSpec, cv: float | None = None) -> float:
    """Factor on a synchronous step's compute for waiting on the slowest of ``world`` ranks."""
    if gpu.name == "CPU":
        return 1.0
    return 1.0 + (STRAGGLER_CV if cv is None else cv) * expected_max_normal(world)


# -- the per-bucket simulator (as slipstream.sync.policy) -------------------------------------------
@dataclass(frozen=True)
class BucketTask:
    ready_s: float  # after the start of backward
    compute_s: float  # codec compute (on the compute core/stream)
    comm_s: float  # time on the wire
    cpu_s: float = 0.0  # part of the communication that keeps the compute core busy (copies, TCP, sums)


@dataclass(frozen=True)
class DpStep:
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: float
    codec_compute_s: float
    exposed_comm_s: float


def simulate_dp_step(forward_s: float, backward_s: float, optimizer_s: float,
                     buckets: Sequence[BucketTask], cycle_s: float = 0.0) -> DpStep:
    """One data-parallel step: buckets become ready through backward and go out on one channel.

    ``core = backward + sum(codec compute) + sum(comm cpu)``;
    ``chan_i = max(ready_i, chan_{i-1}) + compute_i + max(comm_i, cpu_i)``;
    ``step = forward + max(core, chan_last) + optimizer``. Codec compute adds to the core (one
    core per rank locally; on a GPU it shares the SMs with backward) while waits on the wire hide.
    ``cpu_s`` is the communication's own CPU work (gloo on one core: copies, the TCP stack, the
    reduction): it cannot hide behind backward on the same core. It is 0 for GPUs (NCCL).
    ``cycle_s`` (Horovod): the background thread wakes every cycle (a 5 ms sleep, then the
    negotiation: horovod/common/operations.cc as of April 2018), fuses what is ready and enqueues it
    on one CUDA stream; so a bucket is launched at the first wake after it is ready and runs when
    the previous collective on the stream is done.

    >>> simulate_dp_step(0.1, 0.2, 0.01, [BucketTask(0.2, 0.0, 0.05)]).step_s
    0.36
    """
    core = backward_s + sum(b.compute_s + b.cpu_s for b in buckets)
    chan = 0.0
    for b in buckets:
        ready = math.ceil(b.ready_s / cycle_s - 1e-9) * cycle_s if cycle_s > 0 else b.ready_s
        chan = max(ready, chan) + b.compute_s + max(b.comm_s, b.cpu_s)
    end = max(core, chan)
    return DpStep(
        step_s=round(forward_s + end + optimizer_s, 12), forward_s=forward_s, backward_s=backward_s,
        optimizer_s=optimizer_s, comm_s=sum(b.comm_s for b in buckets),
        codec_compute_s=sum(b.compute_s for b in buckets),
        exposed_comm_s=max(0.0, end - backward_s - sum(b.compute_s for b in buckets)),
    )


def two_queue_schedule(compute: Sequence[tuple[float, int | None]], comm: Sequence[tuple[float, int | None]],
                       ) -> tuple[float, float]:
    """Run a compute queue and a communication queue, each in order, with cross dependencies.

    ``compute[i] = (duration, index into comm it waits for, or None)``; ``comm[j] = (duration, index
    into compute it waits for, or None)``. Returns (end of compute, end of comm).

    >>> two_queue_schedule([(1.0, 0), (1.0, 1)], [(0.5, None), (0.5, None)])
    (2.5, 1.0)
    """
    c_end = [0.0] * len(compute)
    m_end = [0.0] * len(comm)
    ci = mi = 0
    c_free = m_free = 0.0
    while ci < len(compute) or mi < len(comm):
        progressed = False
        if ci < len(compute):
            dur, dep = compute[ci]
            if dep is None or dep < mi:
                start = max(c_free, m_end[dep] if dep is not None else 0.0)
                c_free = c_end[ci] = start + dur
                ci += 1
                progressed = True
        if mi < len(comm):
            dur, dep = comm[mi]
            if dep is None or dep < ci:
                start = max(m_free, c_end[dep] if dep is not None else 0.0)
                m_free = m_end[mi] = start + dur
                mi += 1
                progressed = True
        if not progressed:
            raise ValueError("two_queue_schedule: circular dependency between the queues")
    return c_free, m_free


# -- layouts ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How a job is spread over devices (names as slipstream.config / ``slipstream run``)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    zero_stage: int = 3
    sync: str = "allreduce"
    micro_batch: int = 1
    accumulate_steps: int = 1
    activation_checkpointing: bool = False
    precision: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "pp_microbatches", "micro_batch", "accumulate_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"layout: {name} must be >= 1, got {getattr(self, name)}")
        if self.zero_stage not in (2, 3):
            raise ConfigError(f"layout: zero_stage must be 2 or 3, got {self.zero_stage}")
        if self.pp_schedule not in ("gpipe", "1f1b"):
            raise ConfigError(f"layout: pp_schedule must be gpipe or 1f1b, got {self.pp_schedule!r}")

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def microbatches_per_step(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        return (self.pp_microbatches if self.pp > 1 else 1) * self.accumulate_steps

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.microbatches_per_step * self.dp

    def train_fields(self, checkpoint_classes: tuple[str, ...] = ("Block",)) -> dict:
        """The layout as slipstream.config.TrainConfig fields."""
        return {
            "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp,
            "pp_schedule": self.pp_schedule, "pp_microbatches": self.pp_microbatches, "zero_stage": self.zero_stage,
            "sync": self.sync if self.dp_shard == 1 else "allreduce", "precision": self.precision,
            "accumulate_steps": self.accumulate_steps,
            "activation_checkpointing": list(checkpoint_classes) if self.activation_checkpointing else [],
        }

    def label(self) -> str:
        parts = []
        if self.dp_replicate > 1:
            parts.append(f"ddp{self.dp_replicate}")
        if self.dp_shard > 1:
            parts.append(f"fsdp{self.dp_shard}(z{self.zero_stage})")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            parts.append(f"pp{self.pp}({self.pp_schedule},m{self.pp_microbatches})")
        return "x".join(parts) or "single"


# -- group placement -------------------------------------------------------------------------------
def group_link(size: int, stride: int, gpus_per_node: int, gpu: GpuSpec, network: Network) -> tuple[Link, int]:
    """The link a collective over a mesh group sees, and how many nodes the group spans.

    Mesh order [pp, dp_replicate, dp_shard, tp], tp innermost: a group of ``size`` ranks
    ``stride`` apart. Inside one node it runs on NVLink/PCIe. Across nodes, ``members``
    ranks of it sit on each node and ``gpus_per_node / members`` such groups share the node's
    NICs at once, so a ring gets ``nic * members / gpus_per_node`` (a ring crosses the NIC once
    per node, whatever the members per node).
    """
    intra = Link(gpu.intra_bytes_per_s, gpu.intra_latency_s, 0.9, "nvlink")
    if size <= 1 or size * stride <= gpus_per_node:
        return intra, 1
    members = max(1, min(size, gpus_per_node // stride)) if stride < gpus_per_node else 1
    nodes = max(1, size // members)
    share = members / gpus_per_node
    inter = network.link
    bw = inter.bytes_per_s * share
    if members > 1:
        bw = min(bw, intra.bytes_per_s)
    return Link(bw, inter.hop_latency_s, inter.efficiency, inter.fabric), nodes


# -- prediction ------------------------------------------------------------------------------------
@dataclass
class Prediction:
    layout: Layout
    step_s: float
    compute_s: float
    exposed_comm_s: float
    bubble_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    codec_compute_s: float
    optimizer_s: float
    memory: dict[str, float]
    memory_limit_bytes: float
    samples_per_s: float
    scaling_efficiency: float
    notes: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)  # the terms behind the figures, for ``plan --explain``

    @property
    def memory_bytes(self) -> float:
        return sum(self.memory.values())

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit_bytes


def mfu(model: ModelSpec, precision: str, micro_batch: float) -> float:
    """Achievable fraction of peak FLOP/s at this micro-batch: ``mfu * b / (b + b_half)``."""
    base = model.mfu_fp32 if precision == "fp32" else model.mfu_16
    return base * micro_batch / (micro_batch + model.half_batch)


def param_bytes(model: ModelSpec, layout: Layout) -> dict[str, float]:
    """Parameters, gradients and optimizer states per device (ZeRO paper, section 3.1 / 5)."""
    n = model.params / (layout.tp * layout.pp)
    mixed = layout.precision != "fp32"
    w, g = (2.0, 2.0) if mixed else (4.0, 4.0)
    k = (8.0 if model.optimizer == "adam" else 4.0) + (4.0 if mixed else 0.0)  # states (+ fp32 master)
    d = layout.dp_shard
    if d > 1 and layout.zero_stage == 3:
        return {"params": n * w / d, "grads": n * g / d, "optimizer": n * k / d}
    if d > 1:  # stage 2
        return {"params": n * w, "grads": n * g / d, "optimizer": n * k / d}
    return {"params": n * w, "grads": n * g, "optimizer": n * k}


def predict(model: ModelSpec, gpu: GpuSpec, network: Network, layout: Layout, gpus_per_node: int | None = None,
            sync_options: dict | None = None, framework: Framework | None = None,
            straggler_cv: float | None = None) -> Prediction:
    """Step time, memory and scaling efficiency of ``layout``; see the module docstring.

    ``framework``: how gradients are bucketed and launched (default DDP, :data:`FRAMEWORKS`);
    ``straggler_cv``: the per-rank compute jitter (default :data:`STRAGGLER_CV`)."""
    fw = framework or FRAMEWORKS["ddp"]
    from ..sync.compress import Piece, make_codec

    g = gpus_per_node or gpu.gpus_per_node
    L = layout
    notes: list[str] = []
    details: dict = {}
    if L.tp > 1 and model.kind != "transformer":
        raise ConfigError(f"layout: tensor parallel applies to transformers, not {model.name}")
    if L.pp > model.layers:
        raise ConfigError(f"layout: pp({L.pp}) > layers({model.layers}) of {model.name}")
    if L.tp > g:
        raise ConfigError(f"layout: tp({L.tp}) must fit in a node of {g} GPUs")
    peak = gpu.peak_flops(L.precision)
    eff = mfu(model, L.precision, L.micro_batch)
    layers_stage = model.layers / L.pp
    # compute per micro-batch, one stage, one tp shard
    straggle = straggler_factor(L.world, gpu, straggler_cv)
    t_fwd = model.fwd_flops_per_sample * L.micro_batch / (L.tp * L.pp) / (peak * eff) * straggle
    t_bwd = 2 * t_fwd + (t_fwd if L.activation_checkpointing else 0.0)
    act_bytes = 4 if L.precision == "fp32" else 2
    # tensor parallel: 2 all-reduces forward + 2 backward per layer (+2 in the recomputed forward)
    tp_s = 0.0
    if L.tp > 1:
        tlink, _ = group_link(L.tp, 1, g, gpu, network)
        msg = L.micro_batch * model.seq_len * model.d_model * act_bytes
        per = tlink.allreduce_s(msg, L.tp)
        tp_s = layers_stage * per * (4 + (2 if L.activation_checkpointing else 0))
        details["tp"] = {"count": layers_stage * (4 + (2 if L.activation_checkpointing else 0)), "bytes": msg,
                         "each_s": per, "link": tlink.describe()}
    slot = t_fwd + t_bwd + tp_s
    # pipeline: (m + pp - 1) slots of one micro-batch, point-to-point transfer per slot
    m = L.pp_microbatches if L.pp > 1 else 1
    pp_s = 0.0
    if L.pp > 1:
        stride = L.dp_replicate * L.dp_shard * L.tp
        plink, _ = group_link(L.pp, stride, g, gpu, network)
        msg = L.micro_batch * max(1, model.seq_len) * max(1, model.d_model) * act_bytes
        if model.kind != "transformer":
            msg = L.micro_batch * model.act_bytes_per_sample(L.precision) / model.layers
        pp_s = 2 * plink.transfer_s(msg / L.tp)
        details["pp"] = {"bytes": msg / L.tp, "link": plink.describe(), "bubble_fraction": bubble_fraction(L.pp, m)}
    per_optimizer_micro = m * L.accumulate_steps
    pipe_s = (m + L.pp - 1) * (slot + pp_s) if L.pp > 1 else slot
    bubble_s = (L.pp - 1) * (slot + pp_s) if L.pp > 1 else 0.0
    compute_total = L.accumulate_steps * pipe_s  # before data-parallel sync and optimizer
    # optimizer: memory-bound pass over the local states (read + write)
    pb = param_bytes(model, L)
    opt_s = 2 * sum(pb.values()) / gpu.memory_bytes_per_s
    # data-parallel sync of the stage's gradients
    dp_comm = codec_s = exposed = 0.0
    last_bwd = t_bwd + tp_s / 2
    n_local = model.params / (L.tp * L.pp)
    layer_numel = n_local / layers_stage
    grad_bytes = 4 if (L.precision == "fp32" or L.dp_shard == 1) else 2  # DDP reduces fp32 grads
    if L.dp_shard > 1:
        # FSDP: all-gather params per layer (forward, and backward for ZeRO-3), reduce-scatter grads.
        s_link, _ = group_link(L.dp_shard, L.tp, g, gpu, network)
        r_link, _ = group_link(L.dp_replicate, L.tp * L.dp_shard, g, gpu, network)
        nl = max(1, round(layers_stage))
        ag = s_link.all_gather_s(layer_numel * act_bytes, L.dp_shard)
        rs = s_link.reduce_scatter_s(layer_numel * grad_bytes, L.dp_shard)
        ar = r_link.allreduce_s(layer_numel * grad_bytes / L.dp_shard, L.dp_replicate)
        f_layer, b_layer = t_fwd / nl, t_bwd / nl

        def micro(first: bool, last: bool) -> tuple[float, float]:
            compute: list[tuple[float, int | None]] = []
            comm: list[tuple[float, int | None]] = []
            gather_fwd = L.zero_stage == 3 or first
            for _ in range(nl):
                if gather_fwd:
                    comm.append((ag, None))
                    compute.append((f_layer, len(comm) - 1))
                else:
                    compute.append((f_layer, None))
            # backward: the next layer's all-gather is issued (prefetched) before this layer's
            # reduce-scatter, as FSDP does
            ag_at = []
            if L.zero_stage == 3:
                comm.append((ag, None))
                ag_at.append(len(comm) - 1)
            for j in range(nl):
                if L.zero_stage == 3 and j + 1 < nl:
                    comm.append((ag, None))
                    ag_at.append(len(comm) - 1)
                compute.append((b_layer, ag_at[j] if L.zero_stage == 3 else None))
                if last or L.zero_stage == 3:
                    comm.append((rs + (ar if last else 0.0), len(compute) - 1))
            c_end, m_end = two_queue_schedule(compute, comm)
            return c_end, max(c_end, m_end)

        total = 0.0
        k = L.accumulate_steps * m
        for i in range(k) if k <= 3 else (0, 1, k - 1):
            total += micro(i == 0, i == k - 1)[1]
        if k > 3:
            total += (k - 3) * micro(False, False)[1]
        fsdp_compute = k * (t_fwd + t_bwd)
        exposed = max(0.0, total - fsdp_compute)
        dp_comm = nl * k * (ag * (2 if L.zero_stage == 3 else 0) + rs) + nl * ar
        details["dp"] = {"collective": "FSDP: per layer all-gather of parameters"
                         + (" (forward and backward)" if L.zero_stage == 3 else " (first micro-batch)")
                         + " and reduce-scatter of gradients" + (", all-reduce over replicas" if L.dp_replicate > 1
                                                                 else ""),
                         "bytes": n_local * grad_bytes, "ranks": L.dp_shard, "link": s_link.describe(),
                         "calls": nl * k, "latency_steps": L.dp_shard - 1}
        compute_total = L.accumulate_steps * pipe_s + exposed
        step = compute_total + opt_s
        if L.zero_stage == 2:
            step += 0.0  # forward all-gathers counted in the first micro-batch
    elif L.dp_replicate > 1:
        link, nodes = group_link(L.dp_replicate, L.tp, g, gpu, network)
        base, *rest = L.sync.split("+")
        hierarchical = base == "hierarchical" or fw.hierarchical
        codec_name = rest[0] if hierarchical and rest else ("allreduce" if hierarchical else L.sync)
        codec = make_codec(codec_name, **(sync_options or {}).get(codec_name, {}))
        # the local layer's matrix view (a tp shard's, not the whole layer's: the bytes sent)
        rows, cols = layer_matrix(model, layer_numel)
        n = L.dp_replicate
        local_g = max(1, n // nodes) if hierarchical else 1
        intra, _ = group_link(local_g, L.tp, g, gpu, network)
        # hierarchical: local_g rings (one per local rank) cross the nodes at once, sharing the NICs
        inter, _ = group_link(nodes, L.tp * local_g, g, gpu, network)
        # buckets over layers in backward order
        bucket_layers: list[int] = []
        cap, size = fw.first_bucket_bytes, 0.0
        count = 0
        for _ in range(max(1, round(layers_stage))):
            size += layer_numel * 4
            count += 1
            if size >= cap:
                bucket_layers.append(count)
                cap, size, count = fw.bucket_bytes, 0.0, 0
        if count:
            bucket_layers.append(count)
        tasks = []
        done = 0
        per_layer_bwd = last_bwd / max(1, round(layers_stage))
        for nlay in bucket_layers:
            done += nlay
            numel = nlay * rows * cols  # the codec's layout must cover the bucket exactly
            layout = [Piece(j * rows * cols, rows * cols, rows, cols) for j in range(nlay)]
            if hierarchical and local_g > 1:
                shard = numel // local_g
                sub = [Piece(0, shard, max(1, rows // local_g), cols)]
                wb = codec.wire_bytes(shard, nodes, sub)
                inter_s = inter.wire_s(wb, fw.allreduce_steps(nodes) * codec.collectives_per_call) if nodes > 1 else 0.0
                comm = intra.reduce_scatter_s(numel * 4, local_g) + inter_s + intra.all_gather_s(numel * 4, local_g)
                work = shard
            else:
                wb = codec.wire_bytes(numel, n, layout)
                comm = link.wire_s(wb, fw.allreduce_steps(n) * codec.collectives_per_call)
                work = numel
            ccost = 0.0
            if codec.name != "allreduce":
                passes = CODEC_PASSES.get(codec.name, 4)
                ccost = passes * work * 4 * 2 / gpu.memory_bytes_per_s
                if codec.name == "powersgd":
                    ccost += 4 * getattr(codec, "rank", 4) * work / (gpu.fp32_flops * 0.5)
            tasks.append(BucketTask(ready_s=done * per_layer_bwd, compute_s=ccost, comm_s=comm))
        sim = simulate_dp_step(0.0, last_bwd, 0.0, tasks, cycle_s=fw.cycle_s)
        details["dp"] = {
            "collective": ("hierarchical all-reduce (intra-node reduce-scatter, inter-node all-reduce, intra-node "
                           "all-gather)" if hierarchical and local_g > 1 else "all-reduce")
            + (f" with {codec.name}" if codec.name != "allreduce" else ""),
            "bytes": n_local * 4, "ranks": n, "calls": len(tasks),
            "link": (inter if hierarchical and local_g > 1 else link).describe(),
            "latency_steps": fw.allreduce_steps(nodes if hierarchical and local_g > 1 else n),
            "algorithm": fw.algorithm}
        exposed, dp_comm, codec_s = sim.exposed_comm_s, sim.comm_s, sim.codec_compute_s
        step = compute_total + codec_s + exposed + opt_s
    else:
        step = compute_total + opt_s
    # memory per device
    in_flight = 1
    if L.pp > 1:
        in_flight = m if L.pp_schedule == "gpipe" else min(L.pp, m)
    act = model.act_bytes_per_sample(L.precision, L.tp, L.activation_checkpointing) / L.pp
    mem = dict(pb)
    mem["activations"] = act * L.micro_batch * in_flight
    if model.kind == "transformer":
        mem["activations"] += model.logits_bytes_per_sample(L.tp) * L.micro_batch
    if L.dp_shard > 1:
        mem["buffers"] = 2 * layer_numel * (act_bytes + grad_bytes)  # unsharded layer + prefetch
    elif L.dp_replicate > 1:
        mem["buffers"] = 2 * DDP_BUCKET_BYTES
    mem["overhead"] = MEMORY_OVERHEAD_BYTES
    # scaling efficiency: samples/s over N x one device's samples/s at the same micro-batch, no comm
    samples_step = L.global_batch
    sps = samples_step / step
    one = L.micro_batch / (model.fwd_flops_per_sample * L.micro_batch * 3 / (peak * eff))
    scaling = sps / (L.world * one)
    details.update(forward_s=t_fwd, backward_s=t_bwd, micro_batches=per_optimizer_micro, mfu=eff, peak_flops=peak,
                   straggle_factor=straggle, straggler_cv=STRAGGLER_CV if straggler_cv is None else straggler_cv,
                   framework=fw, world=L.world, model_source=model.source, measured_model=model.measured,
                   gpu_source=gpu.source, network=network.spec)
    return Prediction(
        layout=L, step_s=step, compute_s=L.accumulate_steps * m * (t_fwd + t_bwd), exposed_comm_s=exposed,
        bubble_s=L.accumulate_steps * bubble_s, tp_comm_s=tp_s * per_optimizer_micro,
        pp_comm_s=pp_s * per_optimizer_micro, dp_comm_s=dp_comm, codec_compute_s=codec_s, optimizer_s=opt_s,
        memory=mem, memory_limit_bytes=gpu.memory_bytes * MEMORY_USABLE_FRACTION, samples_per_s=sps,
        scaling_efficiency=scaling, notes=notes, details=details,
    )


def bubble_fraction(pp: int, microbatches: int) -> float:
    """Idle fraction of a pipeline flush: ``(pp-1)/(m+pp-1)``."""
    return (pp - 1) / (microbatches + pp - 1)


def ring_allreduce_s(nbytes: float, n: int, bytes_per_s: float, hop_latency_s: float = 0.0) -> float:
    """``2(n-1) hop + 2(n-1)/n S / bw``: the ring all-reduce of the alpha-beta model."""
    return Link(bytes_per_s, hop_latency_s).allreduce_s(nbytes, n)


__all__ = ["BucketTask", "DpStep", "Layout", "Prediction", "bubble_fraction", "group_link", "mfu", "param_bytes",
           "predict", "ring_allreduce_s", "simulate_dp_step", "two_queue_schedule"]
