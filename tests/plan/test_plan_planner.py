"""Planner ranking sanity."""

from __future__ import annotations

import pytest

from slipstream.errors import ConfigError
from slipstream.plan.planner import enumerate_layouts, plan
from slipstream.plan.specs import get_model


def test_gpt7b_on_8x80gb_is_sharded():
    r = plan("gpt-7b", gpus=8, gpu_type="H100", network="400gbit-ib", tokens=1e9)
    best = r.best.layout
    assert best.dp_shard > 1 or best.tp > 1 or best.pp > 1
    assert not any(c.layout.dp_replicate == 8 for c in r.candidates)  # plain DDP never fits
    assert r.rejected_memory > 0
    assert r.best.prediction.fits


def test_slow_network_prefers_compression():
    r = plan("resnet50", gpus=16, gpu_type="V100", network="1gbit")
    assert r.best.layout.sync.endswith("powersgd")
    fast = plan("resnet50", gpus=16, gpu_type="V100", network="8x400gbit-ib")
    assert fast.best.prediction.scaling_efficiency > r.best.prediction.scaling_efficiency


def test_ranking_is_sorted_and_costs_follow_time():
    r = plan("gpt-1.3b", gpus=16, gpu_type="A100", network="100gbit-ib", price=2.0)
    times = [c.time_to_train_s for c in r.candidates]
    assert times == sorted(times)
    c = r.best
    assert c.cost == pytest.approx(c.time_to_train_s / 3600 * 16 * 2.0)
    assert all(x.layout.world == 16 and x.layout.global_batch == r.global_batch for x in r.candidates)


def test_enumeration_covers_the_axes():
    layouts = list(enumerate_layouts(get_model("gpt-1.3b"), 16, 8, 64, "bf16"))
    assert {L.tp for L in layouts} >= {1, 2, 4, 8}
    assert {L.pp for L in layouts} >= {1, 2, 4}
    assert {L.pp_schedule for L in layouts if L.pp > 1} == {"1f1b", "gpipe"}
    assert {L.zero_stage for L in layouts if L.dp_shard > 1} == {2, 3}
    assert any(L.dp_replicate > 1 and L.dp_shard > 1 for L in layouts)  # HSDP
    assert {L.activation_checkpointing for L in layouts} == {False, True}
    assert "hierarchical+powersgd" in {L.sync for L in layouts}
    assert all(L.tp == 1 and L.pp == 1 for L in enumerate_layouts(get_model("resnet50"), 16, 8, 1024, "fp16"))


def test_nothing_fits_is_a_clear_error():
    with pytest.raises(ConfigError, match="no layout of gpt-13b fits"):
        plan("gpt-13b", gpus=1, gpu_type="V100", network="1gbit", precision="fp16")
    with pytest.raises(ConfigError, match="whole nodes"):
        plan("gpt-7b", gpus=12, gpu_type="H100", network="1gbit")
    with pytest.raises(ConfigError, match="bf16"):
        plan("resnet50", gpus=8, gpu_type="V100", network="1gbit", precision="bf16")
