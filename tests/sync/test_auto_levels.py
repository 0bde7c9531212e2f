"""``auto`` chooses between flat and two-level reduction where the topology has both (issue #14, item 1).

Pure: the choice from figures (:func:`slipstream.sync.levels.choose_level`, and
:func:`slipstream.sync.policy.decide` per level as the engine calls it). Spawned: 4 gloo
ranks as 2 nodes of 2 (``_level_workers.levels``, one spawn for every check): ``auto``
takes a level on every rank alike and reports it; a forced hierarchical level trains
through the two-level reducer; verification reverts a slow one to flat; a state saved
after the decision resumes on the same level, bitwise.
"""

from __future__ import annotations

import json
import re

import pytest

from slipstream.network.link import Link
from slipstream.sync.compress import make_codec
from slipstream.sync.levels import FLAT, HIERARCHICAL, LevelLinks, choose_level, explain_level, has_two_levels
from slipstream.sync.policy import BucketInfo, HierarchicalCost, decide
from slipstream.sync.topology import Topology
from tests.harness import free_port, run_ranks
from tests.sync import _level_workers

# -- pure: the choice from figures ------------------------------------------------------------------------


def test_choose_level_takes_the_lower_prediction_and_ties_go_flat():
    assert choose_level({FLAT: 0.080, HIERARCHICAL: 0.095}) == FLAT
    assert choose_level({FLAT: 0.120, HIERARCHICAL: 0.090}) == HIERARCHICAL
    assert choose_level({FLAT: 0.100, HIERARCHICAL: 0.100}) == FLAT


def test_two_levels_only_with_several_nodes_of_several_ranks():
    assert has_two_levels(Topology(0, 4, 0, 2))
    assert not has_two_levels(Topology(0, 4, 0, 4))  # one node
    assert not has_two_levels(Topology(0, 4, 0, 1))  # one rank per node
    assert not has_two_levels(Topology(0, 1, 0, 1))


MB = 1 << 20


def _links(flat_bw: float, intra_bw: float, inter_bw: float) -> LevelLinks:
    alpha = 1e-4
    return LevelLinks(Link.measured(4, alpha, flat_bw),
                      HierarchicalCost(Link.measured(2, alpha, intra_bw), Link.measured(2, alpha, inter_bw), 2, 2))


def _decide_levels(links: LevelLinks) -> tuple[str, dict[str, float]]:
    """What the engine does at its decision: one decide per level on that level's model, then the lower."""
    buckets = [BucketInfo(0, 2 * MB, 0.010), BucketInfo(1, 2 * MB, 0.020)]
    codecs = {"allreduce": make_codec("allreduce"), "bf16": make_codec("bf16")}
    # bf16's compute, measured on each level's codec input (the hierarchical one is half the bucket).
    compute = {FLAT: {(b.index, "bf16"): 2e-3 for b in buckets},
               HIERARCHICAL: {(b.index, "bf16"): 1e-3 for b in buckets}}
    predicted = {level: decide(buckets, links.model(level), 4, compute[level], codecs).predicted_s
                 for level in (FLAT, HIERARCHICAL)}
    return choose_level(predicted), predicted


def test_flat_link_fast_and_slow_inter_node_link_chooses_flat():
    level, predicted = _decide_levels(_links(flat_bw=5e9, intra_bw=5e9, inter_bw=50e6))
    assert level == FLAT and predicted[FLAT] < predicted[HIERARCHICAL], predicted


def test_slow_flat_link_and_fast_node_link_chooses_hierarchical():
    # The flat ring crosses the slow link with 1.5 S per rank; two levels send S/2 of it there.
    level, predicted = _decide_levels(_links(flat_bw=50e6, intra_bw=5e9, inter_bw=50e6))
    assert level == HIERARCHICAL and predicted[HIERARCHICAL] < predicted[FLAT], predicted
    line = explain_level(level, predicted, _links(50e6, 5e9, 50e6))
    assert line.startswith("level hierarchical: predicted") and "against" in line and "flat" in line, line


def test_communication_hidden_on_both_levels_is_a_tie_and_stays_flat():
    # Infinitely fast links: both levels predict backward alone.
    inf = float("inf")
    links = LevelLinks(Link.measured(4, 0.0, inf),
                       HierarchicalCost(Link.measured(2, 0.0, inf), Link.measured(2, 0.0, inf), 2, 2))
    level, predicted = _decide_levels(links)
    assert predicted[FLAT] == predicted[HIERARCHICAL] and level == FLAT, predicted


# -- 4 gloo ranks as 2 nodes of 2 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def levels_results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("levels") / "levels.json")
    run_ranks(_level_workers.levels, 4, free_port(), out, 2, local_world_size=2, timeout_s=600)
    with open(out) as f:
        return json.load(f)


def _ok(section):
    assert "error" not in section, section.get("error")
    return section


@pytest.mark.distributed
def test_auto_takes_one_level_on_every_rank_and_reports_it(levels_results):
    r = _ok(levels_results["natural"])
    assert r["levels_built"] == [FLAT, HIERARCHICAL], r  # both reducers built on a 2x2 topology
    assert r["agree"] and r["same_on_ranks"], r
    st = r["stats"]
    flat_s, hier_s = st["sync_predicted_flat_s"], st["sync_predicted_hierarchical_s"]
    assert flat_s > 0 and hier_s > 0, st
    chosen = choose_level({FLAT: flat_s, HIERARCHICAL: hier_s})
    assert st["sync_level_decision"].startswith(f"level {chosen}: predicted"), st
    # Reverted by verification (measured not faster than the flat steps observed): flat.
    reverted = str(st.get("sync_verification") or "").startswith("reverted")
    assert st["sync_level"] == (FLAT if reverted else chosen), st
    assert st["sync_decision"].endswith(f" on {st['sync_level']}"), st
    modes = [s[0] for s in r["seen"]]
    assert modes[:2] == ["observe", "observe"] and modes[-1] == "run", r["seen"]
    assert all(s[1] == FLAT for s in r["seen"][:2]), r["seen"]  # observed on flat


@pytest.mark.distributed
def test_hierarchical_level_trains_through_two_levels_and_reprobe_observes_on_flat(levels_results):
    r = _ok(levels_results["forced"])
    assert r["agree"] and r["same_on_ranks"], r
    assert [s[:2] for s in r["seen"]] == [["observe", FLAT], ["observe", FLAT], ["run", HIERARCHICAL],
                                          ["run", HIERARCHICAL]], r["seen"]
    st = r["stats"]
    assert st["sync_level"] == HIERARCHICAL and re.fullmatch(r"allreduce:\d+ on hierarchical", st["sync_decision"]), st
    # Bytes of the two-level reducer: a third of the 1.5 S per rank crosses between nodes.
    assert st["sync_inter_node_bytes_sent"] == pytest.approx(st["sync_uncompressed_bytes"] / 3, rel=1e-2), st
    assert r["rel_diff"] <= 1e-5, r  # fp32 sums in another order: DDP's weights
    # request_probe(): the next step re-probes and observes again on flat, then decides anew.
    assert [s[:2] for s in r["after_probe"]] == [["observe", FLAT], ["observe", FLAT], ["run", HIERARCHICAL],
                                                 ["run", HIERARCHICAL]], r["after_probe"]


@pytest.mark.distributed
def test_verification_reverts_a_slow_hierarchical_level_to_flat_allreduce(levels_results):
    r = _ok(levels_results["reverted"])
    assert r["agree"] and r["same_on_ranks"], r
    assert any(s[1] == HIERARCHICAL for s in r["seen"]), r["seen"]  # the forced level ran
    assert r["verification"].startswith("reverted to allreduce"), r["verification"]
    assert r["seen"][-1][:2] == ["run", FLAT], r["seen"]
    assert r["stats"]["sync_level"] == FLAT and r["stats"]["sync_decision"].endswith(" on flat"), r["stats"]


@pytest.mark.distributed
def test_a_guard_trip_on_the_hierarchical_level_moves_to_the_flat_plan_once(levels_results):
    r = _ok(levels_results["retreat"])
    assert r["agree"] and r["same_on_ranks"], r
    runs = [s[:2] for s in r["seen"] if s[0] != "observe"]
    # The hierarchical plan, then (first trip) the flat plan, then (second trip) uncompressed.
    assert runs[0] == ["run", HIERARCHICAL], r["seen"]
    first_flat = runs.index(["run", FLAT])
    assert all(s == ["run", HIERARCHICAL] for s in runs[:first_flat]), r["seen"]
    assert runs[-1] == ["fallback", FLAT] and ["run", HIERARCHICAL] not in runs[first_flat:], r["seen"]
    assert r["verification"].startswith("moved to flat (powersgd:"), r["verification"]
    assert "the guard stopped the hierarchical plan: error-feedback residual" in r["verification"], r
    assert r["fallback"].startswith("error-feedback residual"), r
    # Resumed from a state saved on the hierarchical level, before the trip: the same end, bitwise.
    assert r["saved_level"] == HIERARCHICAL and r["saved_flat_choices"], r
    assert r["resumed_verification"] == r["full_verification"] and r["full_verification"].startswith("moved"), r
    assert r["bitwise"], r
    assert not str(r["no_flat_verification"]).startswith("moved") and r["no_flat_diff"] > 1e-6, r


@pytest.mark.distributed
@pytest.mark.parametrize("codec", _level_workers.RESUME_CODECS)
def test_resume_restores_the_level_bitwise(levels_results, codec):
    r = _ok(levels_results[f"resume/{codec}"])
    assert r["saved_level"] == HIERARCHICAL and r["full_level"] == HIERARCHICAL, r
    assert r["resumed_level"] == HIERARCHICAL and r["resumed_mode"] == "run", r
    assert r["resumed_decision"] == f"{codec}:1 on hierarchical" and r["resumed_steps"] == 8, r
    assert r["inter_node_bytes"] is not None and r["inter_node_bytes"] > 0, r
    assert r["bitwise"] and r["same_on_ranks"], r
    # The check can fail: the same state without its level resumes flat, with other weights.
    assert r["no_level_level"] == FLAT and r["no_level_diff"] > 1e-6, r
