"""The facade's healing collaborator (train/healing.py, issue #44 item 3): the heal's order of
calls, a failed heal (the class size: tests/architecture). Stand-ins
only: no process group (the heals themselves run in tests/integration/test_heal_*.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slipstream.errors import TrainingFailed
from slipstream.train import healing
from slipstream.train.microsteps import MicroSteps


def _parts(calls: list[str], restored_step: int = 3):
    """A layout, healer, recorder and checkpoint manager that write down each call."""
    def note(name, value=None):
        return lambda *args: calls.append(name) or value

    layout = SimpleNamespace(release=note("layout.release"), leave=note("layout.leave"),
                             rejoined=note("layout.rejoined"))
    healer = SimpleNamespace(leave=note("healer.leave"), rejoin=note("healer.rejoin", 0.25),
                             disarm=note("healer.disarm"), generation=2)
    recorder = SimpleNamespace(rejoined=note("recorder.rejoined"))
    checkpoints = SimpleNamespace(left=note("checkpoints.left"), rejoined=note("checkpoints.rejoined"),
                                  restore_latest=note("checkpoints.restore_latest", restored_step),
                                  restored_from="snapshot of step 3")
    return layout, healer, recorder, checkpoints


def test_a_heal_lets_go_forms_again_takes_the_new_group_and_restores_in_that_order(capsys):
    calls: list[str] = []
    layout, healer, recorder, checkpoints = _parts(calls)
    micro = MicroSteps(4)
    micro.index = 2
    heal = healing.InPlaceHealing(healer, layout, recorder, checkpoints, micro,  # type: ignore[arg-type]
                                  SimpleNamespace(rank=0, is_main=True))
    heal.heal(RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"), failed_in=5)
    assert calls == ["layout.release", "healer.leave", "layout.leave", "recorder.rejoined", "checkpoints.left",
                     "healer.rejoin", "layout.rejoined", "checkpoints.rejoined", "recorder.rejoined",
                     "checkpoints.restore_latest"]
    assert micro.index == 0  # the accumulation window starts again from the snapshot
    out = capsys.readouterr().out
    assert out == ("[slipstream] healed in place: a peer was lost in step 5 (RuntimeError: Read error: Connection "
                   "reset by peer); the group formed again in 0.25 s (generation 2) and every rank went back to "
                   "step 3 (snapshot of step 3)\n")


def test_a_heal_with_nothing_to_go_back_to_disarms_the_healer_and_raises_from_the_lost_peer():
    calls: list[str] = []
    layout, healer, recorder, checkpoints = _parts(calls, restored_step=0)
    heal = healing.InPlaceHealing(healer, layout, recorder, checkpoints, MicroSteps(1),  # type: ignore[arg-type]
                                  SimpleNamespace(rank=1, is_main=False))
    lost = RuntimeError("Connection closed by peer")
    with pytest.raises(TrainingFailed, match="rank 1: the group formed again after a lost peer") as exc:
        heal.heal(lost, failed_in=4)
    assert exc.value.__cause__ is lost and calls[-1] == "healer.disarm"
