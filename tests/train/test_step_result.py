"""run.step() is an honest step: it reports what happened and never exits the process,
except when the loop goes on after a step reported stop_requested (single process)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import slipstream
from slipstream import EXIT_PREEMPTED, StepResult


def test_step_result_is_a_frozen_value_whose_truth_is_stepped():
    result = StepResult(stepped=True, step=3, saved=True)
    assert bool(result) and not StepResult(stepped=False, step=3)
    assert (result.logged, result.stop_requested) == (False, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.stepped = False  # type: ignore[misc]
    assert slipstream.train.StepResult is StepResult


def _micro_step(run, x, y) -> StepResult:
    run.backward(nn.functional.mse_loss(run.model(x), y))
    return run.step()


def test_step_reports_stepped_saved_logged_and_stop_without_exiting(single_process, tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = slipstream.accelerate(model, opt, run_dir=str(tmp_path / "run"), checkpoint_dir=str(tmp_path / "ckpt"),
                                checkpoint_every_steps=3, log_every_steps=2, accumulate_steps=2, progress=False)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    results = [_micro_step(run, x, y) for _ in range(6)]  # 3 optimizer steps of 2 micro-steps
    assert [r.stepped for r in results] == [False, True] * 3
    assert [bool(r) for r in results] == [False, True] * 3
    assert [r.step for r in results] == [0, 1, 1, 2, 2, 3]
    assert [r.logged for r in results] == [False, False, False, True, False, False]
    assert [r.saved for r in results] == [False] * 5 + [True]
    assert not any(r.stop_requested for r in results) and not run.stop_requested

    run.checkpoints.preempt_requested = True  # what the SIGTERM handler sets (without its deadline timer)
    assert not _micro_step(run, x, y).stop_requested  # inside the window: nothing to agree on yet
    last = _micro_step(run, x, y)  # the boundary: emergency checkpoint, reported, no exit
    assert (last.stepped, last.step, last.saved, last.stop_requested) == (True, 4, True, True)
    assert run.stop_requested
    assert (tmp_path / "ckpt" / "step_00000004").is_dir()

    # A loop that ignores the report: its next training call ends the process, with 143.
    with pytest.raises(SystemExit) as exited:
        run.step()
    assert exited.value.code == EXIT_PREEMPTED
    with pytest.raises(SystemExit):
        run.backward(nn.functional.mse_loss(run.model(x), y))
    with pytest.raises(SystemExit):
        run.train_step(x, y, nn.functional.mse_loss)


def test_a_loop_that_reads_the_report_stops_and_finishes_cleanly(single_process, tmp_path):
    model = nn.Linear(4, 1)
    run = slipstream.accelerate(model, torch.optim.SGD(model.parameters(), lr=0.01), run_dir=str(tmp_path / "run"),
                                checkpoint_dir=str(tmp_path / "ckpt"), progress=False)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    steps = 0
    while run.step_count < 100:
        if run.step_count == 5:
            run.checkpoints.preempt_requested = True
        steps += 1
        if _micro_step(run, x, y).stop_requested:
            break
    assert steps == 6 and run.step_count == 6
    summary = run.finish()  # no second checkpoint: the emergency one is of this step
    assert summary["steps"] == 6
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_00000006"]
