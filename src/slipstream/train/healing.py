"""Healing in place, the training side: whether a run can, and the heal itself.

Under ``slipstream run`` with healing on, a rank's :class:`~slipstream.resilience.heal.Healer` forms the
default group again when a peer is lost; what holds the old group (the layout and its sync
strategy, the metrics recorder, the snapshots' peer copy) must let go of it and take the new one,
and every rank goes back to the last snapshot they all hold. :func:`heal_refusal` says why a run
cannot (deterministic: a replacement decides as its predecessor did), :func:`start` arms it, and
:class:`InPlaceHealing` is the heal, which the facade (:class:`~.facade.Accelerated`) calls when a
collective fails. Kept apart from the facade so that the step path reads without it.

Example::

    healing = start(run, runtime.healer, micro)   # None: the launcher's full restart stays
    ...
    except Exception as exc:                       # a collective failed in backward, say
        healing.heal(exc, failed_in=run.step_count + 1)
"""

from __future__ import annotations

import re
import traceback
from typing import Protocol

from .. import sync
from ..checkpoint import CheckpointManager
from ..config import TrainConfig
from ..errors import ConfigError, TrainingFailed
from ..metrics import StepRecorder
from ..process.runtime import Runtime
from ..resilience import heal
from .layout import Layout
from .microsteps import MicroSteps


class HealingRun(Protocol):
    """What healing reads of a run: the facade's :class:`~.facade.Accelerated` is one."""

    layout: Layout
    config: TrainConfig
    checkpoints: CheckpointManager | None
    recorder: StepRecorder
    runtime: Runtime


def heal_refusal(run: HealingRun) -> str | None:
    """Why this run cannot heal in place (None: it can). Deterministic, so a replacement decides as
    its predecessor did."""
    mgr = run.checkpoints
    why = run.layout.heal_refusal()
    if why is not None:
        return why
    if not sync.describe(run.config.sync.strategy).heals_in_place:
        return (f"sync {run.config.sync.strategy!r} is registered without heals_in_place: slipstream cannot form "
                "its process groups again or know what it keeps outside its state_dict")
    if mgr is None:
        return "there is no snapshot to go back to"
    if mgr.snapshots is None or not mgr.snapshots.enabled:
        return "in-memory snapshots are off (snapshot_every_steps)"
    # The snapshots' peer copy heals too: its group is formed again with the others
    # (CheckpointManager.left/rejoined), and a replacement on a lost node restores from it.
    return None


def start(run: HealingRun, healer: heal.Healer, micro: MicroSteps) -> InPlaceHealing | None:
    """The run's healing, or None after saying in one line why it cannot heal (the launcher's full
    restart stays). A replacement joins the survivors here, before the restore every rank then
    makes; the caller arms ``healer`` once it has hooked the heal in."""
    why = heal_refusal(run)
    if why is not None:
        healer.disarm()
        if healer.pending:
            raise ConfigError(f"this process replaces a dead rank but cannot heal in place: {why}")
        if run.runtime.is_main:
            # Healing is on by default: the line names the setting, not a flag the user may not have given.
            print(f"[slipstream] healing in place is off for this run: {why}; a failed rank restarts every worker",
                  flush=True)
        return None
    assert run.checkpoints is not None  # heal_refusal: there is a snapshot to go back to
    healing = InPlaceHealing(healer, run.layout, run.recorder, run.checkpoints, micro, run.runtime)
    if healer.pending:
        healer.rejoin()
        healing.rejoined()
    return healing


class InPlaceHealing:
    """A failed collective healed in place: every holder of the broken group lets go of it, the
    healer forms the next generation, every holder takes the new group, and every rank restores
    the newest snapshot they all hold."""

    def __init__(self, healer: heal.Healer, layout: Layout, recorder: StepRecorder, checkpoints: CheckpointManager,
                 micro: MicroSteps, runtime: Runtime) -> None:
        self.healer = healer
        self.layout = layout
        self.recorder = recorder
        self.checkpoints = checkpoints
        self.micro = micro
        self.runtime = runtime

    def heal(self, exc: BaseException, failed_in: int) -> None:
        """Heal after ``exc`` (a lost peer) in step ``failed_in``, or disarm the healer and raise
        (from ``exc``) when the heal itself fails: this process ends, the launcher restarts all."""
        # The failed call's frames (a checkpoint save's, say) hold the broken groups in their locals:
        # cleared, so those groups go when the heal drops them and their sockets close.
        cause: BaseException | None = exc
        for _ in range(8):
            if cause is None:
                break
            traceback.clear_frames(cause.__traceback__)
            cause = cause.__cause__ or cause.__context__
        try:
            self.layout.release()
            self.healer.leave()
            self.leave()
            seconds = self.healer.rejoin()
            self.rejoined()
            step = self.checkpoints.restore_latest()
            if not step:  # nothing to go back to: this state and a replacement's fresh one would differ
                raise TrainingFailed(f"rank {self.runtime.rank}: the group formed again after a lost peer, but "
                                     "no snapshot or checkpoint is held by every rank to go back to")
        except Exception as heal_exc:  # noqa: BLE001 - the heal failed: this process ends, the launcher restarts all
            self.healer.disarm()
            raise heal_exc from exc
        if self.runtime.is_main:
            print(f"[slipstream] healed in place: a peer was lost in step {failed_in} ({first_line(exc)}); "
                  f"the group formed again in {seconds:.2f} s (generation {self.healer.generation}) and every rank "
                  f"went back to step {step} ({self.checkpoints.restored_from})", flush=True)

    def leave(self) -> None:
        """Every holder of the broken group lets go of it, so its sockets close (see heal.Healer.leave)."""
        self.layout.leave()
        self.recorder.rejoined()
        self.checkpoints.left()

    def rejoined(self) -> None:
        """Everything that held the old default group moves to the new one (same order on every rank)."""
        self.layout.rejoined()
        self.checkpoints.rejoined()
        self.recorder.rejoined()
        self.micro.index = 0


def first_line(exc: BaseException) -> str:
    """``exc`` in one short line for the console: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    # gloo's messages start with its source location ("[.../pair.cc:537] Read error ..."): not for users.
    first = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text[0]) if text else ""
    return f"{type(exc).__name__}: {first[:120]}" if first else type(exc).__name__
