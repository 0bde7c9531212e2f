"""``slipstream plan --explain``: the chosen layout's step and memory, term by term, with sources.

Each line names where its number comes from: ``spec sheet`` (specs.py, the vendor's datasheet),
``network SPEC`` (the fabric defaults of network.py, or ``measured`` with --link-calibration),
``model`` (the cost model's equations, docs/plan.md), ``measured`` (this machine, the user's
model measured on the meta device, or a published one-GPU throughput, rates.py), ``published`` (a paper or report, published.py) and
``assumed`` (a stated assumption, e.g. the achievable fraction of peak FLOP/s).

Example::

    result = plan("resnet101", gpus=512, gpu_type="P100", network="25gbit-roce", gpus_per_node=4)
    print(explain(result))
"""

from __future__ import annotations

from .costmodel import STRAGGLER_CV, expected_max_normal
from .planner import PlanResult, fmt_s
from .specs import GIB


def _gb(x: float) -> str:
    return f"{x / GIB:.2f} GiB" if x >= 0.01 * GIB else f"{x / 2**20:.1f} MiB"


def explain(result: PlanResult, index: int = 0) -> str:
    """The step of ``result.candidates[index]`` broken down, each term with its source."""
    c = result.candidates[index]
    p, L, d = c.prediction, c.layout, c.prediction.details
    m, gpu = result.model, result.gpu
    u = result.uncertainty
    lo, hi = u.step_range(p.step_s, p.scaling_efficiency)
    elo, ehi = u.efficiency_range(p.scaling_efficiency)
    cpu = gpu.name == "CPU"
    lines = [
        f"Chosen layout: {L.label()}, sync {L.sync if L.dp_shard == 1 and L.dp_replicate > 1 else '-'}, "
        f"micro-batch {L.micro_batch} x {L.microbatches_per_step} per step, {L.precision}"
        f"{', activation checkpointing' if L.activation_checkpointing else ''}",
        f"Step {fmt_s(p.step_s)} (range {fmt_s(lo)} - {fmt_s(hi)}), scaling efficiency "
        f"{p.scaling_efficiency:.1%} (range {elo:.0%} - {ehi:.0%}) [range: {u.source}]",
        "",
        "Step, per optimizer step:",
    ]
    mfu_src = (f"measured: {m.mfu_source} (rates.py)" if m.mfu_source else
               f"assumed: the model class's achievable fraction of peak (specs.py); no published one-GPU "
               f"throughput of {m.name} on {gpu.name} at {L.precision} in rates.py, which would replace it")
    flops_src = "measured on the meta device (FlopCounterMode)" if d.get("measured_model") else \
        f"published: {m.source}" if m.source else "model"
    k = d["micro_batches"]
    lines.append(f"  compute          {fmt_s(p.compute_s):>10}  forward {fmt_s(d['forward_s'])} + backward "
                 f"{fmt_s(d['backward_s'])} per micro-batch x {k}")
    lines.append(f"    FLOPs/sample {m.fwd_flops_per_sample:.3g} forward (x3 to train) [{flops_src}]; peak "
                 f"{d['peak_flops'] / 1e12:.3g} TFLOP/s {L.precision} [{'measured' if cpu else 'spec sheet: ' + gpu.source}]; "
                 f"{d['mfu']:.0%} of it at micro-batch {L.micro_batch} [{mfu_src}]")
    if d["straggle_factor"] > 1:
        share = p.compute_s * (1 - 1 / d["straggle_factor"])
        lines.append(f"    of which waiting for the slowest of {d['world']} ranks: {fmt_s(share)} "
                     f"(x{d['straggle_factor']:.3f} = 1 + {d['straggler_cv']:g} x E[max of {d['world']} normals] "
                     f"{expected_max_normal(d['world']):.2f}) [fitted: cv on the published record's calibration "
                     f"set, published.fit_straggler_cv]")
    dp = d.get("dp")
    if dp:
        hidden = max(0.0, p.dp_comm_s - p.exposed_comm_s)
        lines.append(f"  {dp['collective']}: {_gb(dp['bytes'])} of gradients over {dp['ranks']} ranks in "
                     f"{dp['calls']} call(s), {fmt_s(p.dp_comm_s)} on the wire [model: alpha-beta, "
                     f"{dp['latency_steps']} latency steps each; link {dp['link']} (network SPEC: "
                     f"{d['network']})]")
        how = ("two queues, compute and communication, the next layer's all-gather issued before this "
               "layer's reduce-scatter" if L.dp_shard > 1 else
               f"buckets of {d['framework'].name} ({d['framework'].source}) sent as backward produces them")
        lines.append(f"    overlapped with compute {fmt_s(hidden)}; exposed {fmt_s(p.exposed_comm_s):>10} "
                     f"[model: {how}]")
        if p.codec_compute_s:
            lines.append(f"    codec compute {fmt_s(p.codec_compute_s)} [model: passes over the gradient at "
                         f"HBM speed]")
    tp = d.get("tp")
    if tp:
        lines.append(f"  tensor parallel  {fmt_s(p.tp_comm_s):>10}  {tp['count'] * k:.0f} all-reduces of "
                     f"{_gb(tp['bytes'])}, {fmt_s(tp['each_s'])} each, not overlapped [model; link {tp['link']}, "
                     f"spec sheet]")
    pp = d.get("pp")
    if pp:
        lines.append(f"  pipeline bubble  {fmt_s(p.bubble_s):>10}  {pp['bubble_fraction']:.0%} of the flush idle "
                     f"((pp-1)/(m+pp-1)) [model]; point-to-point {fmt_s(p.pp_comm_s)} of {_gb(pp['bytes'])} "
                     f"activations per transfer [link {pp['link']}]")
    lines.append(f"  optimizer        {fmt_s(p.optimizer_s):>10}  one read+write pass over the local states at "
                 f"{gpu.memory_bytes_per_s / 1e9:.0f} GB/s [{'measured' if cpu else 'spec sheet'}]")
    lines.append("")
    lines.append(f"Memory per GPU: {_gb(p.memory_bytes)} of {_gb(p.memory_limit_bytes)} usable "
                 f"({'fits' if p.fits else 'does NOT fit'}; {p.memory_bytes / gpu.memory_bytes:.0%} of the "
                 f"device's {_gb(gpu.memory_bytes)}):")
    act_src = ("measured: bytes autograd saves in one forward on the meta device" if m.measured else
               "model: Korthikanti et al. 2022" if m.kind == "transformer" else "assumed: rough per-sample estimate")
    src = {"params": "model: ZeRO paper's bytes per parameter, divided by the shard degree",
           "grads": "model: ZeRO paper", "optimizer": f"model: {m.optimizer} states (ZeRO paper)",
           "activations": act_src, "buffers": "model: DDP buckets / FSDP unsharded layers",
           "overhead": "assumed: CUDA context and caches"}
    names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
    for key, value in p.memory.items():
        lines.append(f"  {names.get(key, key):<16} {_gb(value):>10}  [{src.get(key, 'model')}]")
    return "\n".join(lines)


__all__ = ["explain", "STRAGGLER_CV"]
