"""What one call of ``run.step()`` did, as a value (no exit from inside the step)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepResult:
    """The outcome of :meth:`slipstream.train.Accelerated.step`.

    ``bool(result)`` is ``result.stepped``, so ``if run.step():`` keeps working.

    Example::

        result = run.step()
        if result.stop_requested:           # SIGTERM: the emergency checkpoint is written
            break                           # then run.finish() and exit with EXIT_PREEMPTED (143)
    """

    stepped: bool
    """The optimizer stepped (the last micro-step of an accumulation window)."""
    step: int
    """Optimizer steps done so far (``run.step_count`` after this call)."""
    saved: bool = False
    """A checkpoint of this step was written (started, with ``checkpoint_async``)."""
    logged: bool = False
    """This was a log step: the loss was read back to the host and the ranks
    exchanged their timings (one small all-gather)."""
    stop_requested: bool = False
    """SIGTERM arrived (on any rank) and the emergency checkpoint of this step was
    attempted: stop the loop. The next ``backward()``/``step()``/``train_step()``
    raises ``SystemExit(EXIT_PREEMPTED)``."""

    healed: bool = False
    """A rank failed during this micro-step and the group healed in place (``slipstream run
    --heal``): the state went back to the last snapshot (``step``), the micro-step was
    dropped, and the data loader restarts at the snapshot's position."""

    def __bool__(self) -> bool:
        return self.stepped
