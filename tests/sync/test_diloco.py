"""``diloco``: local steps with no gradient traffic, an outer step every H steps (2 ranks, gloo).

One spawn runs every multi-rank check (tests/sync/_diloco_workers.py::suite): the hook-level
ones, and ``slipstream.accelerate`` with checkpoints, stopped and resumed.
"""

from __future__ import annotations

import pytest

from slipstream.errors import ConfigError
from slipstream.network.link import allreduce_bytes
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    from tests.sync._diloco_workers import suite as fn

    return run_ranks(fn, 2, str(tmp_path_factory.mktemp("diloco")), timeout_s=300)


def _ok(results, name):
    for r in results:
        assert "error" not in r[name], r[name].get("error")
    return [r[name] for r in results]


def test_inner_steps_send_nothing_and_keep_the_local_gradient(suite):
    for r in _ok(suite, "local_gradients"):
        assert r["diff"] == 0.0, r  # DDP's reducer neither averaged nor divided the gradient
        assert r["bytes"] == 0 and r["total"] == 0 and r["steps"] == 1, r
        assert r["grads_differ"], r  # each rank's own data: the gradients differ
        assert r["buffers_broadcast"] == [True, False], r  # DDP's per-forward buffer broadcast: off


def test_h1_lr1_no_momentum_is_synchronous_sgd(suite):
    for r in _ok(suite, "averaging_is_sync_sgd"):
        assert r["rel"] < 1e-5, r


def test_replicas_agree_right_after_each_outer_step_only(suite):
    for r in _ok(suite, "schedule"):
        for s in r["seen"]:
            outer = s["step"] % 4 == 0
            assert s["same"] == outer, s
            assert s["mode"] == ("outer" if outer else "inner"), s
            assert (s["bytes"] > 0) == outer, s
        # one fp32 all-reduce of the whole model per outer step, counted; none in between
        assert r["outer_steps"] == 2 and r["total"] == pytest.approx(2 * r["per_step_allreduce"]), r
        assert r["ratio"] == pytest.approx(4.0), r


def test_fragments_sync_at_their_own_offsets_with_a_16_bit_codec(suite):
    for r in _ok(suite, "fragments_and_codec"):
        assert r["phases"] == [2, 0], r
        step2, step4 = r["seen"][1], r["seen"][3]
        # fragment 0 agrees right after its outer step (2), and trains apart again by step 4
        assert step2["same"] == [True, False] and step4["same"] == [False, True], r["seen"]
        # bf16 on the wire: 2 bytes a value, ring all-reduce of 2 ranks sends S
        assert step2["bytes"] == pytest.approx(allreduce_bytes(2 * r["numel"][0], 2)), r
        assert step4["bytes"] == pytest.approx(allreduce_bytes(2 * r["numel"][1], 2)), r
        assert r["seen"][0]["bytes"] == 0 and r["seen"][2]["bytes"] == 0, r["seen"]


def test_state_dict_resumes_bitwise(suite):
    for r in _ok(suite, "resume_bitwise"):
        assert r["equal"], r
        assert r["without_inner_state_differs"], r  # the check can fail: rank 1's Adam moments matter


def test_overlapped_outer_step_lands_overlap_steps_later(suite):
    for r in _ok(suite, "overlap"):
        by_step = {s["step"]: s for s in r["seen"]}
        # started at 4 (bytes counted then), in flight through 5, landed at 6; again from 8
        assert [by_step[t]["in_flight"] for t in (3, 4, 5, 6, 7, 8)] == [[], [0], [0], [], [], [0]], r["seen"]
        assert [by_step[t]["bytes"] > 0 for t in (3, 4, 5, 6)] == [False, True, False, False], r["seen"]
        assert [by_step[t]["mode"] for t in (3, 4, 5, 6)] == ["inner", "outer", "inner", "outer"], r["seen"]
        # the replicas agree right after the landing (mix 0), not at the start
        assert [by_step[t]["same"] for t in (4, 5, 6, 7)] == [False, False, True, False], r["seen"]
        assert r["err"] < 1e-6, r  # outer lr 1, no momentum: the mean of the step-4 parameters
        assert r["outer_steps"] == 1, r  # the one started at 8 is still in flight at the end
        assert "overlapped 2 step(s)" in r["summary"], r
        assert r["mixed_same"][5] is False, r  # mix 0.5: each keeps half its own value after landing


def test_a_save_while_in_flight_resumes_bitwise(suite):
    for r in _ok(suite, "overlap_resume_bitwise"):
        # H=4, 2 fragments (phases 2 and 0): fragment 1 starts at 4, lands at 6; saved after 5
        assert r["in_flight"] == [1] and r["saved"] == [1], r
        assert r["equal"], r


def test_loss_falls(suite):
    for r in _ok(suite, "loss_falls"):
        assert r["last"] < 0.6 * r["first"], r


def test_accelerate_stopped_and_resumed_ends_bitwise_equal(suite):
    # accelerate(): the checkpoint's "sync" entry restores rank 1's own parameters, buffers
    # and AdamW moments over the shared checkpoint's (rank 0's)
    for r in _ok(suite, "accelerate_resume"):
        assert r["whole_from"] == 0 and r["resumed_from"] == 4, r
        assert r["equal"], r
        assert r["replicas_differ"], r  # step 8 is not an outer step (H=3): the check can fail
        # no zeros all-reduce of the model's size at start: diloco sums no gradient, so its
        # bucket layout is left to DDP (one model's size less over the slow link per start)
        assert r["bucket_order_fixed"] is False, r


def test_refused_with_tp_or_pp_in_one_line():
    # dp_shard composes (tests/sync/test_diloco_sharded.py); tensor and pipeline parallelism do not
    from slipstream.config import TrainConfig

    for degrees in ({"tp": 2}, {"pp": 2}):
        with pytest.raises(ConfigError, match=r"^sync 'diloco' with (tp|pp)\(2\) is not supported") as err:
            TrainConfig(sync="diloco", **degrees)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("options, words", [
    ({"inner_steps": 0}, "inner_steps must be >= 1"),
    ({"outer_lr": 0}, "outer_lr must be > 0"),
    ({"outer_momentum": 1.0}, "outer_momentum must be in [0, 1)"),
    ({"fragments": 5, "inner_steps": 4}, "fragments must be in [1, inner_steps(4)]"),
    ({"outer_codec": "bf61"}, "did you mean 'bf16'"),
    ({"inner_steps": "ten"}, "inner_steps must be a whole number"),
    ({"rank": 4}, "unknown options: rank"),
    ({"inner_steps": 4, "overlap_steps": 4}, "overlap_steps must be in [0, inner_steps(4))"),
    ({"overlap_mix": 1.0}, "overlap_mix must be in [0, 1)"),
])
def test_bad_options_are_refused(options, words):
    from slipstream.sync.options import SyncOptionsError, check_sync_options

    with pytest.raises(SyncOptionsError) as err:
        check_sync_options("diloco", options)
    assert words in str(err.value)


def test_split_fragments_balances_in_order():
    from slipstream.sync.diloco import fragment_phases, split_fragments

    assert split_fragments([4, 4, 4, 4], 2) == [[0, 1], [2, 3]]
    assert split_fragments([10, 1, 1, 10], 2) == [[0, 1], [2, 3]]
    assert fragment_phases(10, 2) == [5, 0] and fragment_phases(50, 1) == [0]
