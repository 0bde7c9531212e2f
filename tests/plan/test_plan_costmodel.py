"""Cost model equations against values computed by hand."""

from __future__ import annotations

import pytest

from slipstream.errors import ConfigError
from slipstream.plan.costmodel import (
    BucketTask,
    Layout,
    bubble_fraction,
    group_link,
    param_bytes,
    predict,
    ring_allreduce_s,
    simulate_dp_step,
    two_queue_schedule,
)
from slipstream.plan.network import Link, parse_network
from slipstream.plan.specs import GIB, get_gpu, get_model


def test_ring_allreduce_alpha_beta():
    # 8 ranks, 100 MB, 10 GB/s, 5 us per hop: 2*7*5us + 2*7/8 * 100e6 / 10e9
    assert ring_allreduce_s(100e6, 8, 10e9, 5e-6) == pytest.approx(14 * 5e-6 + 1.75 * 0.01)
    assert ring_allreduce_s(100e6, 1, 10e9, 5e-6) == 0.0
    link = Link(10e9, 0.0, 0.5)
    assert link.allreduce_s(1e9, 2) == pytest.approx(1e9 / 5e9)  # half the line rate achieved
    assert link.reduce_scatter_s(8e9, 4) == pytest.approx(0.75 * 8e9 / 5e9)


def test_bubble_fraction():
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(1, 8) == 0.0


def test_zero_memory_matches_the_zero_paper():
    # ZeRO paper (Rajbhandari et al. 2020) Figure 1: 7.5B params, Nd = 64, K = 12, mixed precision:
    # baseline 120 GB, stage 1 31.4 GB, stage 2 16.6 GB, stage 3 1.9 GB (we model stages 2 and 3).
    from dataclasses import replace

    gpt = replace(get_model("gpt-7b"), params=7.5e9)
    base = sum(param_bytes(gpt, Layout(dp_replicate=64)).values())
    z2 = sum(param_bytes(gpt, Layout(dp_shard=64, zero_stage=2)).values())
    z3 = sum(param_bytes(gpt, Layout(dp_shard=64, zero_stage=3)).values())
    assert base == pytest.approx(120e9)
    assert z2 == pytest.approx(2 * 7.5e9 + 14 * 7.5e9 / 64)  # 16.64 GB
    assert z3 == pytest.approx(16 * 7.5e9 / 64)  # 1.875 GB
    # fp32 with Adam: 4 + 4 + 8 bytes per parameter
    assert sum(param_bytes(gpt, Layout(precision="fp32")).values()) == pytest.approx(16 * 7.5e9)


def test_simulator_overlap_and_exposed_part():
    # two buckets: comm of the first hides under backward, the second's is exposed
    s = simulate_dp_step(0.1, 0.3, 0.02, [BucketTask(0.1, 0.0, 0.1), BucketTask(0.3, 0.0, 0.2)])
    assert s.step_s == pytest.approx(0.1 + 0.5 + 0.02)
    assert s.exposed_comm_s == pytest.approx(0.2)
    # codec compute adds to the core (one core per rank) and to the channel
    s = simulate_dp_step(0.0, 0.3, 0.0, [BucketTask(0.3, 0.05, 0.0)])
    assert s.step_s == pytest.approx(0.35)


def test_two_queue_schedule_prefetch():
    # all-gathers prefetched: compute waits for the first only
    assert two_queue_schedule([(1.0, 0), (1.0, 1), (1.0, 2)], [(0.5, None)] * 3) == (3.5, 1.5)
    # reduce-scatter after its compute
    assert two_queue_schedule([(1.0, None), (1.0, None)], [(0.2, 0), (0.2, 1)]) == (2.0, 2.2)


def test_network_spec_parsing():
    n = parse_network("25gbit-roce")
    assert n.link.bytes_per_s == pytest.approx(25e9 / 8)
    assert n.link.fabric == "roce" and n.link.hop_latency_s == pytest.approx(5e-6)
    n = parse_network("8x400gbit-ib")
    assert n.link.bytes_per_s == pytest.approx(8 * 400e9 / 8) and n.nics == 8
    n = parse_network("200mbit@2ms")
    assert n.link.bytes_per_s == pytest.approx(25e6) and n.link.hop_latency_s == pytest.approx(2e-3)
    # RATE,RTT as --link writes it: a ring step pays one round trip (measured with gloo on TCP).
    n = parse_network("100mbit,40ms")
    assert n.link.bytes_per_s == pytest.approx(12.5e6) and n.link.hop_latency_s == pytest.approx(0.040)
    assert parse_network("1gbit-tcp,5ms").link.hop_latency_s == pytest.approx(0.005)
    for bad in ("fast", "25gbit-carrierpigeon", "0gbit", "", "100mbit,40ms,0.1%", "100mbit,40", "1gbit@1ms,5ms"):
        with pytest.raises(ConfigError):
            parse_network(bad)


def test_group_link_shares_the_nic():
    gpu, net = get_gpu("A100"), parse_network("100gbit-ib")
    intra, nodes = group_link(8, 1, 8, gpu, net)
    assert nodes == 1 and intra.fabric == "nvlink"
    # dp over 4 nodes with tp=8 inside: one member per node, and the 8 dp groups (one per tp
    # rank) cross the node's NIC at once: each gets an eighth
    link, nodes = group_link(4, 8, 8, gpu, net)
    assert nodes == 4 and link.bytes_per_s == pytest.approx(100e9 / 8 / 8)
    # the whole world in one ring: the NIC to itself
    link, nodes = group_link(32, 1, 8, gpu, net)
    assert nodes == 4 and link.bytes_per_s == pytest.approx(100e9 / 8)
    link, nodes = group_link(16, 2, 8, gpu, net)  # 4 members per node, 2 groups per node
    assert nodes == 4 and link.bytes_per_s == pytest.approx(100e9 / 8 / 2)


def test_predict_compute_and_tp_pp():
    m, gpu, net = get_model("gpt-1.3b"), get_gpu("A100"), parse_network("100gbit-ib")
    one = predict(m, gpu, net, Layout(micro_batch=4))
    eff = m.mfu_16 * 4 / (4 + m.half_batch)
    t_fwd = m.fwd_flops_per_sample * 4 / (312e12 * eff)
    assert one.compute_s == pytest.approx(3 * t_fwd)
    assert one.scaling_efficiency == pytest.approx(3 * t_fwd / one.step_s)
    ckpt = predict(m, gpu, net, Layout(micro_batch=4, activation_checkpointing=True))
    assert ckpt.compute_s == pytest.approx(4 * t_fwd)
    assert ckpt.memory["activations"] < one.memory["activations"] / 5
    tp = predict(m, gpu, net, Layout(tp=4, micro_batch=4))
    assert tp.tp_comm_s > 0 and tp.memory["params"] == pytest.approx(one.memory["params"] / 4)
    # (no straggler term: the bubble's formula is checked on the compute alone)
    pp = predict(m, gpu, net, Layout(pp=4, pp_microbatches=12, micro_batch=4), straggler_cv=0.0)
    slot = 3 * t_fwd / 4
    assert pp.bubble_s == pytest.approx(3 * (slot + pp.pp_comm_s / 12), rel=1e-6)
    with pytest.raises(ConfigError):
        predict(get_model("resnet50"), gpu, net, Layout(tp=2))


def test_compression_pays_on_slow_links_only():
    m, gpu = get_model("resnet50"), get_gpu("V100")
    slow = {s: predict(m, gpu, parse_network("1gbit"), Layout(dp_replicate=16, micro_batch=64, sync=s,
                                                               precision="fp16")).step_s
            for s in ("allreduce", "bf16", "powersgd")}
    assert slow["powersgd"] < slow["bf16"] < slow["allreduce"]
    fast = {s: predict(m, gpu, parse_network("8x400gbit-ib"), Layout(dp_replicate=16, micro_batch=64, sync=s,
                                                                     precision="fp16")).step_s
            for s in ("allreduce", "powersgd")}
    assert fast["powersgd"] >= fast["allreduce"]


def test_memory_gpt7b_ddp_does_not_fit_80gb():
    p = predict(get_model("gpt-7b"), get_gpu("H100"), parse_network("400gbit-ib"),
                Layout(dp_replicate=8, micro_batch=1, accumulate_steps=128))
    assert not p.fits and p.memory_bytes > 100 * GIB
    p = predict(get_model("gpt-7b"), get_gpu("H100"), parse_network("400gbit-ib"),
                Layout(dp_shard=8, micro_batch=1, accumulate_steps=128, activation_checkpointing=True))
    assert p.fits


def test_docstring_examples():
    import doctest

    from slipstream.plan import calibrate, costmodel

    for mod in (costmodel, calibrate):
        failed, attempted = doctest.testmod(mod)
        # Zero examples found (a docstring reformatted out of doctest syntax, or the
        # module's docstrings stripped) is not a pass: the check would check nothing.
        assert attempted > 0, f"{mod.__name__}: no doctest examples found"
        assert failed == 0, mod.__name__
