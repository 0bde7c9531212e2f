"""The one link model (slipstream.network.link): ring formulas, spec links, measured links."""

from __future__ import annotations

import pytest
import torch

from slipstream.network.link import Link, all_gather_bytes, allreduce_bytes, allreduce_steps, reduce_scatter_bytes
from slipstream.plan.calibrate import link_from_probe
from slipstream.plan.network import parse_network
from slipstream.sync.compress import Cast, Codec, PowerSGD, ScaledSign, TopK


@pytest.mark.parametrize("n,allreduce,reduce_scatter", [(1, 0, 0), (2, 1000, 500), (4, 1500, 750), (8, 1750, 875)])
def test_ring_bytes_per_rank_known_values(n, allreduce, reduce_scatter):
    assert allreduce_bytes(1000, n) == allreduce
    assert reduce_scatter_bytes(1000, n) == reduce_scatter
    # All-gather takes each rank's shard: gathering 1000/n from everyone sends what reduce-scatter does.
    assert all_gather_bytes(1000 / n, n) == reduce_scatter
    assert allreduce_steps(n) == 2 * (n - 1)


def test_codecs_count_their_bytes_with_the_ring_formulas():
    numel, n = 1 << 20, 4
    assert Codec().wire_bytes(numel, n) == allreduce_bytes(numel * 4, n) == 1.5 * numel * 4
    assert Cast(torch.bfloat16).wire_bytes(numel, n) == allreduce_bytes(numel * 2, n)
    topk = TopK(0.01)
    assert topk.wire_bytes(numel, n) == all_gather_bytes(topk.k_of(numel) * 8, n)
    # Plain fp32 values (no matrix layout) through PowerSGD: an all-reduce of the values as they are.
    assert PowerSGD(rank=4).wire_bytes(numel, n) == allreduce_bytes(numel * 4, n)
    sign = ScaledSign()  # an all-gather of packed signs: (n-1) times one rank's payload
    assert sign.wire_bytes(numel, n) == all_gather_bytes(sign.wire_bytes(numel, 2), n)


def test_spec_link_alpha_beta_times():
    link = parse_network("100gbit-ib").link  # 12.5 GB/s, 2 us per hop, 0.9 achieved
    assert isinstance(link, Link) and link.ranks == 0
    s, n = 100e6, 8
    assert link.allreduce_s(s, n) == pytest.approx(14 * 2e-6 + 1.75 * s / (0.9 * 12.5e9))
    assert link.reduce_scatter_s(s, n) == link.all_gather_s(s, n) == pytest.approx(7 * 2e-6 + 0.875 * s / (0.9 * 12.5e9))
    assert link.allreduce_s(s, 1) == 0.0
    with pytest.raises(ValueError, match="ranks"):
        link.seconds(s)  # a spec link fits any group: say which one


def test_measured_link_gives_back_its_figures():
    link = Link.measured(2, 1e-4, 125e6, samples=[(8192, 2e-4), (4 << 20, 0.034)])
    assert (link.ranks, link.alpha_s, link.bytes_per_s, link.efficiency) == (2, 1e-4, 125e6, 1.0)
    assert link.samples == ((8192, 2e-4), (4 << 20, 0.034))
    assert link.seconds(125e6, 2) == 2e-4 + 1.0  # two collectives' latency, 1 s of bytes
    assert link.allreduce_s(0, 2) == 1e-4
    assert link.summary() == "2 ranks, latency 0.10 ms, 1.000 Gbit/s"
    four = Link.measured(4, 3e-4, 1e9)
    assert four.alpha_s == pytest.approx(3e-4) and four.hop_latency_s == pytest.approx(5e-5)
    solo = Link.measured(1, 0.0, float("inf"))
    assert solo.seconds(1e9, 3) == 0.0 and solo.summary() == "single rank"


def test_the_planner_reads_a_measured_link():
    planner = link_from_probe(Link.measured(4, 3e-4, 1e8, samples=[(1, 1.0)]))
    assert (planner.ranks, planner.samples, planner.fabric, planner.efficiency) == (0, (), "probed", 1.0)
    assert planner.allreduce_s(0, 4) == pytest.approx(3e-4)
    assert planner.allreduce_s(1e8, 4) == pytest.approx(3e-4 + 1.5)
