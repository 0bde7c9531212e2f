"""Healing in place with every mechanism of the sync strategies (issue #43 item 2), at 2 ranks.

Each case runs the fault-injection worker under ``slipstream run --heal`` with two SIGKILLs
(rank 1 at step 3, rank 0 at step 7) beside an uninterrupted reference run with the same
strategy, and checks what tests/integration/test_heal_in_place.py checks: final parameters and
optimizer state bitwise equal, the sample ledger, each dead rank replaced in place and no full
restart, nothing left running. The cases cover the state a strategy keeps beside DDP's; every
strategy's groups and state, the casts' direct path and hierarchical's two levels included, are
checked in one spawn at unit level (tests/sync/test_heal_rejoin.py), which keeps the suite's
time (each case here is two launches: 30-60 s on 2 cores):

* ``powersgd``: its Q factors and error-feedback residuals, on the ordering thread;
* ``auto``: its decision (forced onto PowerSGD: its timings differ run to run) and probed link,
  which the replacement takes from the snapshot instead of probing alone;
* ``diloco``: the outer copy and momentum, each rank's own replica and inner optimizer, the outer
  all-reduce every 3 steps (a kill lands inside a period).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.integration.test_fault_tolerance import SCRIPT, launch
from tests.integration.heal_checks import REPO, check
from tests.integration.test_heal_in_place import STEPS, _no_leftovers

KILLS = "1:3,0:7"

CASES = {
    "powersgd": ["--sync", "powersgd", "--sync-options", json.dumps({"rank": 1})],
    "auto": ["--sync", "auto", "--force-auto-codec", "powersgd",
             "--sync-options", json.dumps({"candidates": ["powersgd"], "observe_steps": 2, "verify_steps": 0,
                                           "rank": 1})],
    "diloco": ["--sync", "diloco", "--sync-options", json.dumps({"inner_steps": 3, "outer_momentum": 0.9})],
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_heal_with_the_strategy_bitwise(tmp_path, case):
    ref_out, out = tmp_path / "ref", tmp_path / "healed"
    pids = tmp_path / "pids"
    pids.mkdir()
    common = ["--global-batch", "8", "--steps", str(STEPS), "--every", "100", *CASES[case]]
    reference = subprocess.Popen(
        [sys.executable, "-m", "slipstream", "run", "--standalone", "-n", "2", SCRIPT, "--out", str(ref_out),
         "--ckpt", str(tmp_path / "ref_ckpt"), *common],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    healed = launch("--standalone", "-n", "2", "--heal", "--snapshot-every-steps", "1", SCRIPT, "--out", str(out), "--ckpt", str(tmp_path / "ckpt"),
                    "--kill-at", KILLS, *common, env={"SLIPSTREAM_HEAL_PID_DIR": str(pids)}, timeout=300)
    ref_log, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_log[-3000:]
    text = healed.stdout + healed.stderr
    assert "healing in place is off" not in text, text[-4000:]  # no refusal: the strategy heals
    # DiLoCo's snapshots are taken where the ranks meet, every H (inner_steps) steps: a heal goes back
    # to one every rank holds, so a kill may cost up to H steps redone (the others: one).
    redone = json.loads(CASES[case][CASES[case].index("--sync-options") + 1]).get("inner_steps", 1) \
        if case == "diloco" else 1
    killed = [tuple(map(int, k.split(":"))) for k in KILLS.split(",")]
    check(healed, ref_out, out, 2, STEPS, len(killed), markers=[f"killed_{r}_{s}" for r, s in killed],
          redone_per_fault=redone)
    _no_leftovers(tmp_path)
    if case == "auto":  # the forced plan ran to the end in both (and came back with each heal's snapshot)
        for run_out in (ref_out, out):
            assert torch.load(run_out / "final.pt", weights_only=True)["sync_decision"] == "powersgd:1", run_out
