"""The run's checkpoint duties around the step, and rank 0's lines about them.

After each optimizer step a checkpoint is saved when due (at once and blocking after SIGTERM)
and an in-memory snapshot taken; a preempted run reports its stop once and then refuses to go
on; a resumed run says where it went on from and what differs, then, at its first step, whether
its batch changed; at the end the last state is saved. :class:`Checkpointing` holds what those
lines need to remember between steps. The manager itself is the run's (``run.checkpoints``,
None without checkpoints): each call takes it. Kept apart from the facade
(:class:`~.facade.Accelerated`) so that the step path reads without it.

Example::

    saved, preempted = checkpointing.save_when_due(run.checkpoints, run.step_count)
    if preempted:
        checkpointing.report_stop(run.checkpoints, run.step_count)
"""

from __future__ import annotations

import torch

from ..checkpoint import CheckpointManager
from ..errors import EXIT_PREEMPTED
from ..metrics import StepRecorder
from ..process.runtime import Runtime
from . import resume


class Checkpointing:
    """Saves when due; what rank 0 says about preemption and resume, said once each."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime  # rank 0 speaks: read at each line (Runtime.is_main)
        self.stop_reported = False  # a step reported stop_requested: the next training call exits 143
        # Rank 0, on resume: the batch the checkpoint's run had (compared at this run's first step),
        # and whether "nothing to train" was said at start already (total_steps reached).
        self.saved_samples_per_step: int | None = None
        self.said_complete = False

    def save_when_due(self, mgr: CheckpointManager, step: int) -> tuple[bool, bool]:
        """(saved, preempted): save when due, or now and blocking after SIGTERM (ranks agree)."""
        due, preempted = mgr.should_save(step)
        saved = mgr.save(step, blocking=preempted) if due else False
        if not preempted:
            mgr.maybe_snapshot(step)
        return saved, preempted

    def report_stop(self, mgr: CheckpointManager | None, step: int) -> None:
        """SIGTERM's checkpoint is written (or failed): say so, and refuse training calls from now on."""
        self.stop_reported = True
        if self.runtime.is_main:
            written = (f"checkpoint of step {step} written" if mgr is None or not mgr.last_save_failed
                       else f"the emergency checkpoint of step {step} failed (above); the newest one "
                            f"is step {mgr.last_saved_step}")
            print(f"[slipstream] preempted (SIGTERM): {written}; step() reports stop_requested, "
                  f"exit with code {EXIT_PREEMPTED}", flush=True)

    def refuse_after_stop(self, step: int, recorder: StepRecorder) -> None:
        """Exit 143 when the loop goes on after a step reported ``stop_requested``; else nothing."""
        if not self.stop_reported:
            return
        if self.runtime.is_main:
            print(f"[slipstream] the loop went on after step {step} reported stop_requested "
                  f"(SIGTERM); exiting with code {EXIT_PREEMPTED}", flush=True)
        recorder.close()
        raise SystemExit(EXIT_PREEMPTED)

    def check_batch(self, step_samples: int | None) -> None:
        """After a resume, the first optimizer step's batch compared once with the batch of the
        run that wrote the checkpoint."""
        saved, self.saved_samples_per_step = self.saved_samples_per_step, None
        if saved is not None and step_samples is not None and saved != step_samples:
            print(resume.batch_line(saved, step_samples), flush=True)

    def report_resume(self, mgr: CheckpointManager, step: int, script_hyperparameters: list,
                      optimizer: torch.optim.Optimizer, total_steps: int | None) -> None:
        """Rank 0's lines on resume: where from and what differs (one line), and, when the run's
        planned length is reached already, that there is nothing to train."""
        saved = mgr.restored_run or {}  # empty: an in-memory snapshot (this launch) or an older checkpoint
        now = mgr.describe_run() if mgr.describe_run is not None else {}
        changes = resume.differences(saved, now) if saved else []
        changes += resume.hyperparameter_differences(script_hyperparameters, resume.hyperparameters(optimizer))
        print(resume.resumed_line(str(mgr.restored_from), step, changes), flush=True)
        self.saved_samples_per_step = saved.get("samples_per_step")
        if total_steps is not None and step >= total_steps:
            self.said_complete = True
            print(resume.complete_line(mgr.directory, step, total_steps), flush=True)

    def finish(self, mgr: CheckpointManager | None, step: int, resumed_from_step: int | None,
               total_steps: int | None) -> None:
        """The run ends: a resumed run whose loop took no step says there was nothing left to train;
        the final state is saved when the newest checkpoint is older, and the manager closed."""
        if (self.runtime.is_main and resumed_from_step is not None and step == resumed_from_step
                and not self.stop_reported and not self.said_complete and mgr is not None
                and mgr.directory is not None):  # in-memory snapshots only: no run on disk to name
            print(resume.complete_line(mgr.directory, step, total_steps), flush=True)
        if mgr is not None:
            mgr.save_final(step)  # the final state, for a clean resume (ranks agree)
            mgr.close()

