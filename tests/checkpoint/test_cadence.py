"""The measured snapshot cadence (slipstream.checkpoint.cadence): the rule with fixed timings, and
the agreement of two ranks with different timings on one K (a heal goes back to a snapshot every
rank holds). The cadence inside a healed run: tests/integration/test_heal_snapshots.py."""

from __future__ import annotations

import os

import pytest

from slipstream.checkpoint.cadence import MEASURED_SNAPSHOTS, WARMUP_SNAPSHOTS, Cadence, Choice, every_steps_for
from tests.harness import run_ranks


@pytest.mark.parametrize("stall_s, step_s, every", [
    (0.0003, 0.045, 1),     # 0.7% of the step: every step
    (0.00045, 0.045, 1),    # exactly 1%
    (0.0005, 0.045, 2),     # 1.1%: every other step, 0.56% each
    (0.003, 0.1, 3),        # 3% of the step: 1% at every third
    (0.006, 0.010, 60),     # a large state beside a small step
    (0.0, 0.010, 1),        # snapshots off on this rank: nothing stalls
    (0.001, 0.0, 100),      # no step time measured: as rare as 1 / budget
])
def test_every_steps_is_the_smallest_that_keeps_the_stall_under_one_percent(stall_s, step_s, every):
    assert every_steps_for(stall_s, step_s) == every
    if step_s > 0 and stall_s > 0:
        assert stall_s / every <= 0.01 * step_s * (1 + 1e-9)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(cadence: Cadence, clock: Clock, first: int, last: int, step_s: float, stalls: dict[int, float],
          agree=None) -> tuple[list[tuple[int, Choice]], list[int]]:
    """Steps ``first``..``last`` as the manager reports them: each step takes ``step_s``, and a
    snapshot of step s (when scheduled) stalls ``stalls.get(s, 0.001)``. Returns the choices made
    (with their step) and the steps snapshotted."""
    chosen, taken = [], []
    for step in range(first, last + 1):
        clock.now += step_s  # the step itself
        cadence.step_began()
        if cadence.scheduled(step):
            stall = stalls.get(step, 0.001)
            clock.now += stall
            cadence.took(step, stall)
            taken.append(step)
        choice = cadence.step_ended(step, agree)
        if choice is not None:
            chosen.append((step, choice))
    return chosen, taken


def test_the_cadence_measures_after_the_warm_up_then_keeps_to_its_choice():
    clock = Clock()
    cadence = Cadence(None, clock=clock)
    cadence.restart(0)
    # The two first snapshots reserve their slots (slow); they are not measured.
    decided, taken = drive(cadence, clock, 1, 20, step_s=0.02, stalls={1: 0.5, 2: 0.5})
    at = WARMUP_SNAPSHOTS + MEASURED_SNAPSHOTS
    assert decided == [(at, Choice(5, 0.001, pytest.approx(0.02)))]  # 1 ms of a 20 ms step is 5%: every 5th
    assert taken == [1, 2, 3, 4, 5, 10, 15, 20]
    assert decided[0][1].line() == "[slipstream] snapshots every 5 steps: stall 1.0 ms of a 20.0 ms step (1.0%)"


def test_a_restore_measures_again_from_the_step_restored():
    clock = Clock()
    cadence = Cadence(None, clock=clock)
    cadence.restart(0)
    drive(cadence, clock, 1, 12, step_s=0.02, stalls={})
    assert cadence.every_steps == 5
    cadence.restart(10)  # a heal went back to step 10: every step until the ranks agree again
    assert cadence.every_steps == 1 and cadence.scheduled(11)
    decided, _ = drive(cadence, clock, 11, 20, step_s=0.2, stalls={})
    assert decided == [(10 + WARMUP_SNAPSHOTS + MEASURED_SNAPSHOTS, Choice(1, 0.001, pytest.approx(0.2)))]


def test_a_cadence_the_user_set_is_never_measured():
    clock = Clock()
    cadence = Cadence(3, clock=clock)
    cadence.restart(0)
    assert drive(cadence, clock, 1, 20, step_s=0.001, stalls={}) == ([], [3, 6, 9, 12, 15, 18])
    assert cadence.every_steps == 3 and not cadence.measuring


def _agree_in_a_manager(rank: int, world: int, shm: str, stalls_s: list[float]) -> dict:
    """A manager of in-memory snapshots only (no checkpoint_dir), its stalls made ``stalls_s[rank]``."""
    import slipstream
    import torch
    from slipstream.checkpoint.manager import CheckpointManager
    from slipstream.checkpoint.snapshots import MemorySnapshots

    os.environ.update({"SLIPSTREAM_SNAPSHOT_DIR": shm, "TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0"})
    slipstream.init()
    model = torch.nn.Linear(4, 2)
    mgr = CheckpointManager(None, snapshot_auto=True)
    mgr.register("model", model)
    assert mgr.restore_latest() == 0
    real_take = MemorySnapshots.take

    def take(self, step, shared, per_rank):  # the copy as it is; its measured stall set by the test
        real_take(self, step, shared, per_rank)
        self.stall_s[-1] = stalls_s[rank]

    MemorySnapshots.take = take
    clock = Clock()
    mgr.snapshots.cadence._clock = clock
    for step in range(1, 13):
        clock.now += 0.05
        mgr.maybe_snapshot(step)
    held = mgr.snapshots.steps()
    never_on_disk = sorted(os.listdir(shm))
    mgr.close()
    return {"every": mgr.snapshots.every_steps, "choice": mgr.snapshots.cadence.choice, "held": held,
            "shm": never_on_disk}


@pytest.mark.distributed
def test_two_ranks_with_different_stalls_agree_on_one_cadence(tmp_path):
    # Alone, rank 0 would snapshot every step (0.1 ms of a 50 ms step), rank 1 every 4th (2 ms): both take every 4th.
    ranks = run_ranks(_agree_in_a_manager, 2, str(tmp_path / "shm"), [0.0001, 0.002])
    assert [r["every"] for r in ranks] == [4, 4]
    assert ranks[0]["choice"] == ranks[1]["choice"] == Choice(4, 0.002, pytest.approx(0.05))
    for r in ranks:  # every step until the choice at step 5, then every 4th: the same steps on both ranks
        assert r["held"] == [8, 12]
        assert r["shm"] == ["slipstream-snapshots"]  # no checkpoint_dir: the snapshots are all there is


def test_a_device_copy_is_timed_on_its_events_not_by_the_hosts_wait(tmp_path, monkeypatch):
    # On CUDA a copy to the host first waits for the step's queued kernels: that wait (0.3 s here,
    # made in the end event's synchronize) is the step's time; the copies' own time is the events'
    # (2 ms here). The events are faked: this machine has no GPU (docs/gpu.md).
    import time

    import torch

    from slipstream.checkpoint import snapshots
    from slipstream.checkpoint.snapshots import MemorySnapshots

    class Event:
        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            time.sleep(0.3)  # stands for the queued kernels the copy waited for

        def elapsed_time(self, end: "Event") -> float:
            return 2.0  # milliseconds, as torch.cuda.Event.elapsed_time

    monkeypatch.setattr(snapshots, "_copy_events", lambda tensors: (Event(), Event()))
    snaps = MemorySnapshots.for_run(None, 0, 1, None, environ={"SLIPSTREAM_SNAPSHOT_DIR": str(tmp_path)})
    snaps.take(1, {"model": torch.nn.Linear(4, 2)}, {})
    assert 0.002 <= snaps.stall_s[-1] < 0.2, snaps.stall_s


def test_snapshots_land_only_where_every_rank_synchronizes():
    """DiLoCo's ranks meet every H steps and train alone between: a snapshot off those steps can be
    one the dead rank never took while the survivor overwrote the last common one (a heal then
    found none: tests/integration/test_heal_strategies.py[diloco], one run of two under load)."""
    from slipstream.checkpoint.cadence import Cadence

    cadence = Cadence(None)
    cadence.align_to(3)
    cadence.restart(0)
    clock = iter(range(1000))
    cadence._clock = lambda: float(next(clock))
    taken, choice = [], None
    for step in range(1, 40):
        cadence.step_began()
        if cadence.scheduled(step):
            taken.append(step)
            cadence.took(step, 0.5)  # a stall that calls for a snapshot every 50 steps of 1 s
        choice = cadence.step_ended(step, None) or choice
    assert taken and all(step % 3 == 0 for step in taken)
    assert choice is not None and choice.every_steps % 3 == 0 and choice.every_steps >= 50
    fixed = Cadence(2)
    fixed.align_to(3)
    assert fixed.every_steps == 3 and not fixed.scheduled(2) and fixed.scheduled(6)


def test_every_sync_handle_says_how_often_the_ranks_meet():
    from slipstream import sync
    from slipstream.sync.diloco import DiLoCo
    from slipstream.sync.hooks import HookSync
    from slipstream.sync.options import SyncOptions

    assert sync.AllreduceState.steps_between_syncs == 1 == HookSync.steps_between_syncs
    handle = object.__new__(DiLoCo)  # the property reads only the options (building one needs a group)
    handle.opts = SyncOptions.parse("diloco", {"inner_steps": 7})
    assert handle.steps_between_syncs == 7
