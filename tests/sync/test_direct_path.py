"""The direct path: the stateless casts run one async all-reduce per bucket, with no ordering thread.

Results come from the 2-rank suite (``_workers.suite``, check ``direct``).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed


def _direct(suite_results):
    section = suite_results["direct"]
    assert "error" not in section, section.get("error")
    return section


@pytest.mark.parametrize("strategy", ("bf16", "fp16"))
def test_casts_with_default_options_use_no_ordering_thread(suite_results, strategy):
    r = _direct(suite_results)[strategy]
    assert r["steps"] == 4, r
    assert r["queued_jobs"] == 0, r  # every bucket of every step went direct
    assert r["threads_added"] == 0, r  # no slipstream-sync thread was started


@pytest.mark.parametrize("strategy", ("bf16", "fp16"))
def test_casts_are_bitwise_their_formula(suite_results, strategy):
    # Each parameter's averaged gradient equals, bit for bit, the cast of every rank's own
    # gradient summed in 16 bits and decoded: what Cast.reduce computed on the ordered path.
    r = _direct(suite_results)[strategy]
    assert r["checked"] == 4 * 6 and r["bitwise"], r


def test_auto_plan_of_casts_goes_direct(suite_results):
    r = _direct(suite_results)["auto_casts"]
    assert r["guard"], r  # powersgd is a candidate: the guard exists, and must not force the queue
    # DDP's first step, then 2 observed (observe_steps=2); decided at the end of step 3.
    assert r["modes"][:3] == ["observe", "observe", "run"], r["modes"]
    assert r["decision"] == "bf16:2", r
    # Observing queues every bucket (the engine's control step follows the last); from step 4
    # on, nothing is queued.
    assert r["jobs"][2] == r["jobs"][-1] > 0, r["jobs"]
    assert r["same_on_ranks"], r
