"""``auto``'s observation window and what it reports (2-rank suite, check ``auto``)."""

from __future__ import annotations

import pytest

from slipstream.sync.options import DEFAULTS

pytestmark = pytest.mark.distributed


def test_default_window_is_two_steps_after_ddps_first(suite_results):
    assert DEFAULTS.observe_steps == 2
    r = suite_results["auto"]
    assert "error" not in r, r.get("error")
    w = r["default_window"]
    # Step 1 (DDP's initial bucketing) is not used; steps 2-3 are observed; it runs from step 4.
    assert w["modes"] == ["observe", "observe", "run", "run"], w["modes"]


def test_every_decision_reaches_stats(suite_results):
    w = suite_results["auto"]["default_window"]
    st = w["stats"]
    buckets = st["sync_decisions"]
    assert sorted(str(b["bucket"]) for b in buckets) == sorted(w["choices"]), (buckets, w["choices"])
    for b in buckets:
        assert b["codec"] == w["choices"][str(b["bucket"])], b
        assert b["numel"] > 0 and b["ready_s"] >= 0 and b["comm_s"] > 0 and b["compute_s"] >= 0, b
    assert st["sync_predicted_s"] > 0 and st["sync_predicted_allreduce_s"] > 0, st
    assert 0 < st["sync_predicted_backward_s"] <= st["sync_predicted_allreduce_s"], st
    assert st["sync_decision_reason"] and "ranks" in st["sync_link"], st
    assert st["sync_mode"] == "run", st
    # The convergence gate's figures: each lossy candidate's share of the observed gradient.
    kept = st["sync_retained"]
    assert set(kept) == {"bf16", "powersgd"} and all(0.0 <= v <= 1.0 for v in kept.values()), kept
    assert kept["bf16"] > 0.99, kept
    assert set(st["sync_excluded"]) == {n for n, v in kept.items() if v < DEFAULTS.min_retained}, st
