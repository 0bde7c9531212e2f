"""The rule of which group and device every collective uses, checked on every call.

Two ranks run every hook strategy (guard checks, auto's observation, agreement
and verification, a re-probe) and a checkpoint round trip under
``StrictCollectives`` (see there): host-side figures only on gloo host groups,
data only on the data device, never a float64 figure nor a tensor the host
built on a group that inherits the training backend (NCCL on GPUs), and the
configured timeout on every group. The checker's own checks (each violation
injected) are in test_strict_collectives.py.
"""

from __future__ import annotations

import json

import pytest

from tests.harness import free_port, run_ranks


@pytest.fixture(scope="module")
def rule_results(tmp_path_factory):
    from tests.sync import _strict_workers

    out = str(tmp_path_factory.mktemp("rule") / "rule.json")
    # One rank per node: the hierarchical strategies use the inter-node group.
    run_ranks(_strict_workers.rule, 2, free_port(), out, 1, local_world_size=1, timeout_s=900)
    with open(out) as f:
        return json.load(f)


def test_every_strategy_ran(rule_results):
    assert rule_results["errors"] == {}
    assert rule_results["restored_step"] == 1


def test_no_collective_breaks_the_group_and_device_rule(rule_results):
    assert rule_results["violation_count"] == 0, "\n\n".join(rule_results["violations"])
    # Both kinds were exercised: agreements on the control group, data on the data groups.
    assert rule_results["host_calls"] > 10 and rule_results["data_calls"] > 10
    # The placement rule (where each tensor would live on a GPU) judged every tensor:
    # none was made out of the placements' reach, and both sides were seen.
    placements = rule_results["placements"]
    assert not [k for k in placements if k.endswith("untold")], placements
    assert placements.get("host host", 0) > 10 and placements.get("data device", 0) > 10, placements


def test_every_group_carries_the_configured_timeout(rule_results):
    from tests.sync._strict_workers import TIMEOUT_S

    assert rule_results["groups"] >= 6
    assert rule_results["group_timeouts_s"] == [TIMEOUT_S]
