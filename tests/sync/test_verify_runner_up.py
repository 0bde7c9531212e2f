"""``auto`` verifies the best plan of casts beside a lossy plan predicted close to it, and
keeps the lossy one only where it measures clearly faster (one process: the control wire of
one rank agrees with itself)."""

from __future__ import annotations

import pytest

from slipstream.network.link import Link
from slipstream.process.timing import HostClock
from slipstream.sync.accounting import StepRecord
from slipstream.sync.auto import AutoPolicy
from slipstream.sync.compress import make_codec
from slipstream.sync.compress.base import layout_from_shapes
from slipstream.sync.control import ControlWire
from slipstream.sync.options import SyncOptions
from slipstream.sync.policy import BucketInfo, Decision, decide

LINK = Link.measured(ranks=2, alpha_s=1e-4, bytes_per_s=125e6)  # 1 Gbit/s
LOSSY = {0: "powersgd", 1: "allreduce"}
CASTS = {0: "bf16", 1: "allreduce"}


def _policy(**options) -> AutoPolicy:
    return AutoPolicy(SyncOptions(**options), ControlWire(None), world_size=2, link=LINK, prober=lambda: LINK)


def _decided(auto: AutoPolicy, cast_predicted_s: float | None = 0.105) -> None:
    auto.decision = Decision(dict(LOSSY), 0.100, 0.200, 0.050, LINK, "test",
                             cast_choices=dict(CASTS) if cast_predicted_s else {}, cast_predicted_s=cast_predicted_s)
    auto.choices = dict(LOSSY)


def _steps(auto: AutoPolicy, span_s: float) -> list[bool]:
    """Feed the verify window (one warm step + verify_steps) of steps that took ``span_s``."""
    out = []
    for _ in range(1 + auto.options.verify_steps):
        s = StepRecord(t_backward_start=None)
        s.span_s, s.resolved = span_s, True
        out.append(auto.verify(s, HostClock()))
    return out


def test_decide_names_the_best_cast_plan_beside_a_lossy_one():
    buckets = [BucketInfo(0, 1 << 20, 0.050, layout_from_shapes([(1024, 1024)])), BucketInfo(1, 1 << 10, 0.051, None)]
    codecs = {n: make_codec(n) for n in ("allreduce", "bf16", "powersgd")}
    cost = {(b.index, n): 0.0 for b in buckets for n in codecs}
    d = decide(buckets, Link.measured(ranks=2, alpha_s=1e-4, bytes_per_s=25e6), 2, cost, codecs)
    assert "powersgd" in d.choices.values(), d.explain()
    assert set(d.cast_choices.values()) <= {"bf16", "allreduce"} and "bf16" in d.cast_choices.values()
    assert d.predicted_s <= d.cast_predicted_s < d.predicted_allreduce_s
    casts_only = decide(buckets, Link.measured(ranks=2, alpha_s=1e-4, bytes_per_s=25e6), 2, cost,
                        {n: codecs[n] for n in ("allreduce", "bf16")})
    assert casts_only.cast_choices == {} and casts_only.cast_predicted_s is None


def test_a_lossy_plan_that_does_not_beat_the_casts_gives_way_to_them():
    auto = _policy(verify_steps=3)
    _decided(auto)
    assert auto.begin_verification(0.300, {"powersgd"}) == CASTS and auto.choices == CASTS  # the casts first
    assert auto.verifying
    assert _steps(auto, 0.100) == [False, False, False, True]  # their steps in: now the lossy plan's
    assert auto.choices == LOSSY and auto.verifying
    assert _steps(auto, 0.098) == [False, False, False, True]  # 2% faster is not 5%: the casts are kept
    assert auto.choices == CASTS and not auto.verifying
    assert "kept" in auto.verification and "not 5% faster" in auto.verification, auto.verification


def test_a_lossy_plan_clearly_faster_than_the_casts_is_kept():
    auto = _policy(verify_steps=2)
    _decided(auto)
    auto.begin_verification(0.300, {"powersgd"})
    _steps(auto, 0.100)
    assert _steps(auto, 0.080) == [False, False, False]  # kept: nothing changes
    assert auto.choices == LOSSY and not auto.verifying
    assert "the plan of casts alone 100.0 ms" in auto.verification, auto.verification


def test_the_cast_plan_is_not_timed_where_it_is_predicted_far_behind_or_the_rule_is_off():
    auto = _policy()
    _decided(auto, cast_predicted_s=0.120)  # 20% behind the lossy plan's 100 ms (margin 15%)
    assert auto.begin_verification(0.300, {"powersgd"}) is None and auto.choices == LOSSY and auto.verifying
    off = _policy(verify_runner_up=0.0)
    _decided(off)
    assert off.begin_verification(0.300, {"powersgd"}) is None and off.choices == LOSSY
    none = _policy()
    _decided(none, cast_predicted_s=None)
    assert none.begin_verification(0.300, {"powersgd"}) is None


def test_both_plans_slower_than_all_reduce_revert():
    auto = _policy(verify_steps=1)
    _decided(auto)
    auto.begin_verification(0.090, {"powersgd"})
    assert _steps(auto, 0.100) == [False, True]
    assert _steps(auto, 0.095) == [False, True]  # casts kept over the lossy plan, then neither beats 90 ms
    assert set(auto.choices.values()) == {"allreduce"} and auto.verification.startswith("reverted"), auto.verification


def test_option_is_checked():
    assert SyncOptions().verify_runner_up == 0.15
    with pytest.raises(ValueError, match="verify_runner_up"):
        SyncOptions(verify_runner_up=1.0)
