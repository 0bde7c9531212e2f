"""Kill anywhere (issue #43 item 5): healing in place survives a fault in every phase of a step.

A fault is a SIGKILL, or a SIGSTOP (a rank that hangs), delivered to one rank's training
process while a chosen phase really runs (scripts_chaos.py wraps the function that runs it):
data loading, the forward, the backward, DDP's comm hook with the all-reduce in flight, the
optimizer step, a disk checkpoint save, an in-memory snapshot, a peer copy, and the heal
itself (a second death while the group forms again). Every case ends bitwise equal to an
uninterrupted run with the checks of heal_checks.py (weights, optimizer state, the sample
ledger, every death replaced in place, no full restart, nothing left running).

A SIGSTOPped rank never fails by itself: the others' collective times out
(``--collective-timeout-s``), and the rank that has not left the failed generation one
collective timeout later is killed by its own supervisor's spare (slipstream.resilience.heal: the
eviction), then replaced in place like a dead one.

Two forms:

* the reduced form (always): DDP at 2 and at 4 ranks and FSDP2 at 2, each one launch with
  faults of several phases at different steps of the same run (each fault heals before the next
  one fires), every phase once on DDP, within the suite's budget;
* the full matrix (``SLIPSTREAM_CHAOS_FULL=1``): one launch per (ranks, layout, phase),
  the case alone in its run. ``python3 -m pytest -q tests/integration/test_heal_chaos.py``
  with ``SLIPSTREAM_CHAOS_FULL=1`` in the environment.

Layouts: DDP, and FSDP2 (``--dp-shard 2``: at 4 ranks that is HSDP, 2 replicas of 2 shards),
whose sharded parameters and optimizer state come back from the in-memory snapshots. The
comm-hook phase is DDP's alone (FSDP2 reduces in its own collectives). The ``peer-copy`` phase
is not in the matrix: a peer copy runs only across nodes (an emulated cluster), and its loss
is tested by tests/integration/test_heal_node_loss.py.
"""

from __future__ import annotations

import os

import pytest

from tests.integration.heal_checks import check, no_leftovers, run_pair

FULL = os.environ.get("SLIPSTREAM_CHAOS_FULL") == "1"
COLLECTIVE_TIMEOUT_S = 4.0  # how soon a SIGSTOPped rank is noticed (and evicted one timeout later)
LAYOUTS: dict[str, list[str]] = {  # the worker's options, for both runs of a case
    "ddp": [],
    "dp_shard": ["--dp-shard", "2"],
}
SAVE_EVERY = 5  # a disk checkpoint after iterations 4, 9, 14, ... (the save phase's steps)
# Both runs: DDP's reduction through a Python comm hook, for the comm-hook phase.
COMMON = ["--every", str(SAVE_EVERY), "--wrap-comm-hook"]
LAUNCH = ["--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S)]


def _markers(faults: list[str]) -> list[str]:
    return [f"chaos_{f.split(':')[0]}_{f.split(':')[1]}_{f.split(':')[2]}" for f in faults]


def _run(tmp_path, nproc: int, layout: str, steps: int, faults: list[str]) -> None:
    healed, ref_out, out = run_pair(tmp_path, nproc, steps, ["--chaos", ",".join(faults)],
                                    common=[*COMMON, *LAYOUTS[layout]], launch_args=LAUNCH)
    # Two steps redone per fault: a rank that dies after the step's last collective (in the
    # optimizer step, the snapshot, a save) has no snapshot of that step while the survivors do;
    # they find out in the next step's collective and all go back to the previous snapshot.
    check(healed, ref_out, out, nproc, steps, len(faults), markers=_markers(faults), redone_per_fault=2)
    no_leftovers(tmp_path)


# --- the reduced form: many phases in one launch ------------------------------------------------
# Each fault fires at its own step, after the previous one healed; the phases are split over the
# launches so that every phase runs once on DDP, and FSDP2 loses a rank in the phases where its
# sharded state is in motion (the full matrix runs each phase at both sizes on both layouts).
# "R:1:heal" kills rank R at the entry of generation 1's join: the survivor of the first fault,
# while the group forms again.
REDUCED = {
    "2-ddp": (2, "ddp", ["1:1:data", "0:1:heal", "1:3:comm-hook", "0:5:snapshot", "1:7:forward:STOP"]),
    "4-ddp": (4, "ddp", ["2:1:backward", "1:3:optimizer", "3:4:save"]),
    "2-dp_shard": (2, "dp_shard", ["1:1:backward", "0:3:optimizer", "1:4:save"]),
}
STEPS_REDUCED = 10


@pytest.mark.parametrize("case", sorted(REDUCED))
def test_many_phases_in_one_run_heal_bitwise(tmp_path, case):
    nproc, layout, faults = REDUCED[case]
    _run(tmp_path, nproc, layout, STEPS_REDUCED, faults)


# --- the full matrix (opt-in) -------------------------------------------------------------------
CASES = {  # phase: the faults of its run at 2 ranks (at 4: rank 1 -> 2 and rank 0 -> 3, see below)
    "data": ["1:3:data"],
    "forward": ["1:3:forward"],
    "backward": ["1:3:backward"],
    "comm-hook": ["1:3:comm-hook"],  # DDP's reduction only: not a case for other layouts
    "optimizer": ["1:3:optimizer"],
    "save": ["1:4:save"],
    "snapshot": ["1:3:snapshot"],
    "heal": ["1:3:data", "0:1:heal"],
    "stop": ["1:3:forward:STOP"],
}
MATRIX = [(phase, nproc, layout) for phase in sorted(CASES) for nproc in (2, 4) for layout in sorted(LAYOUTS)
          if phase != "comm-hook" or layout == "ddp"]

if FULL:  # collected only when asked for: the suite runs the reduced form above
    @pytest.mark.parametrize("phase,nproc,layout", MATRIX)
    def test_matrix(tmp_path, phase, nproc, layout):
        faults = CASES[phase]
        if nproc == 4:  # a rank in the middle of the ring, and the heal's second death on another one
            faults = [f.replace("1:", "2:", 1) if f.startswith("1:") else f.replace("0:", "3:", 1) for f in faults]
        _run(tmp_path, nproc, layout, 8, faults)
