"""``auto``'s low-communication recommendation: DiLoCo priced on its measured link after it decides.

No process group: an :class:`AutoPolicy` is given a decision and two observed steps by hand (host
clock marks), with a fake measured link, and prices DiLoCo as ``observe()`` does after deciding.
"""

from __future__ import annotations

import json
import logging

import pytest

from slipstream.network.link import Link
from slipstream.network.lowcomm import DilocoSetting
from slipstream.process.timing import HostClock
from slipstream.sync.accounting import StepRecord
from slipstream.sync.auto import AutoPolicy, flat_link
from slipstream.sync.levels import LevelLinks
from slipstream.sync.options import SyncOptions
from slipstream.sync.policy import Decision, FlatCost, HierarchicalCost

GPT = 437_760  # examples/train_gpt.py at --dim 128 --layers 2: 1.75 MB of fp32 gradients
# 100 Mbit/s with a 40 ms round trip as the probe measured it on the emulated cluster: alpha two hops
# of 42 ms, 0.85 of the rate (benchmarks/results/link-delay.md).
SLOW = Link.measured(ranks=2, alpha_s=0.084, bytes_per_s=0.85 * 12.5e6)
FAST = Link.measured(ranks=2, alpha_s=2e-4, bytes_per_s=1.25e9)  # 10 Gbit/s


def _auto(link) -> AutoPolicy:
    return AutoPolicy(SyncOptions(), control=None, world_size=2, link=link, prober=lambda: link)


def _steps(period_s: float, before_exposed_s: float, buckets=((0, GPT // 2), (1, GPT - GPT // 2))):
    """The step before (its forward ended at t=10 s) and the observed one, ``period_s`` later."""
    before = StepRecord(t_backward_start=(10.0, None))
    before.exposed_s = before_exposed_s
    last = StepRecord(t_backward_start=(10.0 + period_s, None))
    for i, n in buckets:
        last.numel[i], last.itemsize[i] = n, 4
    return before, last


def _decide(auto: AutoPolicy, link: Link, backward_s: float) -> Decision:
    # All-reduce everywhere, its exposed communication the link's time for the whole gradient.
    exposed = link.seconds(GPT * 4, collectives=2)
    auto.decision = Decision({0: "allreduce", 1: "allreduce"}, backward_s + exposed, backward_s + exposed,
                             backward_s, link, "test")
    return auto.decision


def test_slow_link_and_a_large_gradient_get_a_recommendation_with_numbers():
    auto = _auto(SLOW)
    d = _decide(auto, SLOW, backward_s=0.025)
    # The loop's step without communication: 0.290 s between forward ends, 0.250 s of it waiting.
    before, last = _steps(period_s=0.290, before_exposed_s=0.250)
    a = auto.price_lowcomm(last, before, HostClock())
    assert a is auto.lowcomm
    assert auto.lowcomm_compute_from == "measured" and a.compute_s == pytest.approx(0.040)
    per_step = 0.040 + (d.predicted_s - d.backward_s)  # 40 ms + 2 x 84 ms + 1.75 MB / 10.6 MB/s
    assert a.per_step_s == pytest.approx(per_step) and a.per_step_utilisation == pytest.approx(0.040 / per_step)
    # H=10: 0.084 + 1,751,040 / 1.0625e7 = 0.2488 s each 10 steps, 62 %; H=50: 89 %: named.
    outer = 0.084 + GPT * 4 / 1.0625e7
    by = {e.setting: e for e in a.estimates}
    assert by[DilocoSetting(10)].utilisation == pytest.approx(0.040 / (0.040 + outer / 10))
    assert a.recommendation is by[DilocoSetting(50)]
    assert a.recommendation.utilisation == pytest.approx(0.040 / (0.040 + outer / 50))
    assert a.speedup(a.recommendation) == pytest.approx(per_step / (0.040 + outer / 50))
    line = auto.recommendation()
    assert line.startswith("recommend --sync diloco (inner_steps=50): predicted utilisation 89% against 11%")
    assert "changes the optimisation" in line
    assert line.endswith("""slipstream run --sync diloco --sync-options '{"inner_steps": 50}' ...""")
    st = auto.figures()
    assert st["sync_recommendation"] == line
    low = st["sync_lowcomm"]
    assert low["compute_from"] == "measured" and low["recommended"]["setting"] == "diloco H=50"
    assert set(low["utilisation"]) == {"diloco H=10", "diloco H=50", "diloco H=100", "diloco H=50 F=5 bf16"}
    json.dumps(st)  # the metrics sinks write it as it is


def test_fast_link_gets_no_recommendation():
    auto = _auto(FAST)
    _decide(auto, FAST, backward_s=0.025)
    before, last = _steps(period_s=0.043, before_exposed_s=0.003)
    a = auto.price_lowcomm(last, before, HostClock())
    assert a.per_step_utilisation > 0.9 and a.recommendation is None and "not below 50%" in a.reason
    st = auto.figures()
    assert st["sync_recommendation"] is None and st["sync_lowcomm"]["recommended"] is None


def test_without_a_step_before_the_compute_is_estimated_from_the_backward():
    auto = _auto(SLOW)
    _decide(auto, SLOW, backward_s=0.030)
    _, last = _steps(0.0, 0.0)
    a = auto.price_lowcomm(last, None, HostClock())
    assert auto.lowcomm_compute_from == "estimated" and a.compute_s == pytest.approx(0.045)
    # A period shorter than the backward is a clock surprise: the estimate again.
    before, last = _steps(period_s=0.260, before_exposed_s=0.250)
    auto.price_lowcomm(last, before, HostClock())
    assert auto.lowcomm_compute_from == "estimated"


def test_the_flat_link_of_each_link_model():
    assert flat_link(SLOW) is SLOW and flat_link(FlatCost(SLOW, 2)) is SLOW
    hier = HierarchicalCost(FAST, SLOW, 2, 2)
    assert flat_link(LevelLinks(SLOW, hier)) is SLOW
    assert flat_link(hier) is None and flat_link(None) is None  # hierarchical+auto: nothing priced
    auto = _auto(hier)
    _decide(auto, SLOW, backward_s=0.025)
    assert auto.price_lowcomm(_steps(0.3, 0.2)[1], None, HostClock()) is None


class AgreeAsIs:
    """The control wire of one rank: every agreement is this rank's own figures."""

    def agree(self, values, op=None):
        return list(values)


def _observed(t0: float, ready: tuple[float, float], exposed_s: float) -> StepRecord:
    step = StepRecord(t_backward_start=(t0, None))
    for i, (r, n) in enumerate(zip(ready, (GPT // 2, GPT - GPT // 2))):
        step.ready[i], step.numel[i], step.itemsize[i] = (t0 + r, None), n, 4
    step.t_last_ready = (t0 + max(ready), None)
    step.t_done = (t0 + max(ready) + exposed_s, None)
    return step


def test_observe_prices_diloco_after_deciding_and_logs_the_line(caplog):
    """observe() itself, on one rank with no process group (rank 0's log): DDP's first step, then
    the observed one 0.29 s later, all-reduce the only candidate (nothing to time)."""
    from slipstream.sync.compress.base import Codec

    auto = AutoPolicy(SyncOptions(candidates=("allreduce",)), AgreeAsIs(), 2, SLOW, lambda: SLOW)
    clock, codecs = HostClock(), {"allreduce": Codec()}
    with caplog.at_level(logging.INFO, logger="slipstream.sync"):
        assert not auto.observe(_observed(10.0, (0.020, 0.025), 0.250), 1, clock, "cpu", {}, codecs)
        assert auto.observe(_observed(10.290, (0.020, 0.025), 0.250), 2, clock, "cpu", {}, codecs)
    assert auto.lowcomm_compute_from == "measured" and auto.lowcomm.compute_s == pytest.approx(0.040)
    # The decision: two buckets of 0.875 MB, each 84 ms + 82.4 ms on the wire, one after the other.
    each = 0.084 + GPT // 2 * 4 / 1.0625e7
    assert auto.decision.predicted_s == pytest.approx(0.020 + 2 * each, rel=1e-3)
    assert auto.lowcomm.per_step_s == pytest.approx(0.040 + auto.decision.predicted_s - 0.025)
    assert auto.lowcomm.recommendation.setting == DilocoSetting(50)
    assert "sync auto: recommend --sync diloco (inner_steps=50): predicted utilisation 89%" in caplog.text
    assert auto.figures()["sync_recommendation"] == auto.recommendation()
