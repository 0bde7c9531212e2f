"""The facade's checkpoint collaborator (train/checkpointing.py, issue #44 item 3): a preempted
run's stop said once and then refused, a resumed run's changed batch said once. Stand-ins only;
the whole paths run in tests/train/test_step_result.py and tests/train/test_resume.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slipstream.errors import EXIT_PREEMPTED
from slipstream.train.checkpointing import Checkpointing


def test_a_stop_is_reported_once_then_every_training_call_exits_143(capsys):
    duty = Checkpointing(SimpleNamespace(is_main=True))  # type: ignore[arg-type]
    closed = []
    recorder = SimpleNamespace(close=lambda: closed.append(True))
    duty.refuse_after_stop(7, recorder)  # type: ignore[arg-type]  # nothing reported yet: goes on
    assert not duty.stop_reported and closed == []
    duty.report_stop(SimpleNamespace(last_save_failed=False), 7)  # type: ignore[arg-type]
    assert duty.stop_reported
    assert capsys.readouterr().out == ("[slipstream] preempted (SIGTERM): checkpoint of step 7 written; step() reports "
                                       f"stop_requested, exit with code {EXIT_PREEMPTED}\n")
    with pytest.raises(SystemExit) as exc:
        duty.refuse_after_stop(7, recorder)  # type: ignore[arg-type]
    assert exc.value.code == EXIT_PREEMPTED and closed == [True]
    assert "the loop went on after step 7 reported stop_requested" in capsys.readouterr().out


def test_a_resumed_runs_changed_batch_is_said_at_its_first_step_only(capsys):
    duty = Checkpointing(SimpleNamespace(is_main=True))  # type: ignore[arg-type]
    duty.saved_samples_per_step = 8  # what report_resume keeps from the checkpoint's record
    duty.check_batch(16)
    assert capsys.readouterr().out == ("[slipstream] the batch differs from the checkpoint's: 16 samples per rank "
                                       "per optimizer step now, 8 in the run that wrote it\n")
    duty.check_batch(32)
    assert capsys.readouterr().out == ""
