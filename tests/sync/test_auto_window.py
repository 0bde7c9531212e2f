"""``auto``'s observation window and what it reports (2-rank suite, check ``auto``)."""

from __future__ import annotations

import pytest

from slipstream.sync.options import DEFAULTS

pytestmark = pytest.mark.distributed


def test_default_window_is_one_step_after_ddps_first(suite_results):
    assert DEFAULTS.observe_steps == 1
    r = suite_results["auto"]
    assert "error" not in r, r.get("error")
    w = r["default_window"]
    # Step 1 (DDP's initial bucketing) is not used; step 2 is observed and decided at its
    # end; the plan runs from step 3 (where torch's PowerSGD hook starts, with start_powerSGD_iter=2).
    assert w["modes"] == ["observe", "run", "run", "run"], w["modes"]


def test_every_decision_reaches_stats(suite_results):
    w = suite_results["auto"]["default_window"]
    st = w["stats"]
    buckets = st["sync_decisions"]
    assert sorted(str(b["bucket"]) for b in buckets) == sorted(w["decided"]), (buckets, w["decided"])
    for b in buckets:
        assert b["codec"] == w["decided"][str(b["bucket"])], b
        assert b["numel"] > 0 and b["ready_s"] >= 0 and b["comm_s"] > 0 and b["compute_s"] >= 0, b
    # What runs now is the decision, or its cast plan while that one is verified first (a cast plan
    # predicted within verify_runner_up of a lossy one: a fact of the measured codec times, which
    # load moves; comparing the running plan with the decision failed 2 of 3 runs at load 14).
    assert w["choices"] in (w["decided"], w["cast_choices"]), w
    assert st["sync_predicted_s"] > 0 and st["sync_predicted_allreduce_s"] > 0, st
    assert 0 < st["sync_predicted_backward_s"] <= st["sync_predicted_allreduce_s"], st
    assert st["sync_decision_reason"] and "ranks" in st["sync_link"], st
    assert st["sync_mode"] == "run", st
    # The convergence gate's figures: each lossy candidate's share of the observed gradient.
    kept = st["sync_retained"]
    assert set(kept) == {"bf16", "powersgd"} and all(0.0 <= v <= 1.0 for v in kept.values()), kept
    assert kept["bf16"] > 0.99, kept
    assert set(st["sync_excluded"]) == {n for n, v in kept.items() if v < DEFAULTS.min_retained}, st
    # DiLoCo priced on the same link, the compute from the step before the observed one (DDP's
    # first): that step reaches the pricing on every run. Whether its period is used is a timing
    # fact, not a wiring one: the observed backward of this tiny model is ~2 ms, so one preemption
    # under load makes it longer than the whole step before it, and the rule then keeps the
    # estimate (both branches are pinned with fixed records in test_auto_lowcomm.py). Here the
    # rule is checked against the figure it was given.
    low, priced = st["sync_lowcomm"], w["priced"]
    assert priced["before_given"], priced
    backward_s = st["sync_predicted_backward_s"]
    if priced["period_less_exposed_s"] > backward_s:
        assert low["compute_from"] == "measured", (low, priced, backward_s)
        assert low["compute_s"] == pytest.approx(priced["period_less_exposed_s"]), (low, priced)
    else:
        assert low["compute_from"] == "estimated", (low, priced, backward_s)
        assert low["compute_s"] == pytest.approx(1.5 * backward_s), (low, backward_s)
    assert 0 < low["compute_s"] < low["per_step_s"], low
    assert (st["sync_recommendation"] is None) == (low["recommended"] is None), st


def test_no_codec_is_timed_where_none_could_help(suite_results):
    # On a link fast enough that even a codec of no compute cost gains nothing, the decision
    # step times nothing: one all-reduce of the ready times, then all-reduce everywhere.
    w = suite_results["auto"]["fast_link_window"]
    assert w["modes"] == ["observe", "run", "run", "run"], w["modes"]
    st = w["stats"]
    assert set(w["choices"].values()) == {"allreduce"}, w["choices"]
    assert "codecs not timed" in st["sync_decision_reason"], st["sync_decision_reason"]
    assert st["sync_retained"] == {} and all(b["compute_s"] == 0.0 for b in st["sync_decisions"]), st
    # Communication hidden on this link: per-step sync wins, DiLoCo is priced but not recommended.
    assert st["sync_recommendation"] is None and st["sync_lowcomm"]["per_step_utilisation"] > 0.5, st


def test_the_start_up_probe_is_sized_to_the_models_gradient(suite_results):
    # auto's one start-up probe, at 8 KiB and at the model's gradient (clamped), not 4 MiB.
    from slipstream.sync.auto import probe_sizes

    w = suite_results["auto"]["default_window"]
    assert w["probed_sizes"] == [list(probe_sizes(w["gradient_bytes"]))], w["probed_sizes"]
    assert w["probed_sizes"][0][1] < 4 << 20, w
