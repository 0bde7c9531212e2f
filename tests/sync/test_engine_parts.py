"""Single-process tests of the engine's typed parts: options, modes, the handle every strategy returns."""

from __future__ import annotations

import pytest

from slipstream.sync.modes import TRANSITIONS, Mode
from slipstream.sync.options import DEFAULTS, SyncOptions


def test_options_parse_and_refuse():
    opts = SyncOptions.parse("auto", {"observe_steps": 3, "rank": 8, "loss_window": 5})
    assert (opts.observe_steps, opts.codec_kwargs("powersgd"), opts.guard_kwargs()["loss_window"]) == (3, {"rank": 8}, 5)
    assert SyncOptions.parse("hierarchical+topk", {"density": 0.1}).codec_kwargs("topk") == {"density": 0.1}
    with pytest.raises(TypeError, match="unknown options: rank"):
        SyncOptions.parse("bf16", {"rank": 8})
    with pytest.raises(TypeError, match="unknown options: warmup_steps"):
        SyncOptions.parse("auto", {"warmup_steps": 2})
    with pytest.raises(ValueError, match="observe_steps"):
        SyncOptions(observe_steps=0)
    assert SyncOptions(candidates=("bf16",)).auto_candidates == ("allreduce", "bf16")


def test_one_source_of_defaults():
    from slipstream.sync.guard import ConvergenceGuard
    from slipstream.sync.policy import decide

    guard = ConvergenceGuard()
    assert (guard.check_every_steps, guard.max_error_ratio, guard.loss_window, guard.loss_tolerance) == (
        DEFAULTS.check_every_steps, DEFAULTS.max_error_ratio, DEFAULTS.loss_window, DEFAULTS.loss_tolerance)
    import inspect

    assert inspect.signature(decide).parameters["hidden_tolerance"].default == DEFAULTS.hidden_tolerance
    with pytest.raises(Exception):
        DEFAULTS.observe_steps = 5  # frozen


def test_mode_transitions():
    assert Mode.initial(auto=True, warmup_steps=3) is Mode.OBSERVE
    assert Mode.initial(auto=False, warmup_steps=3) is Mode.WARMUP
    assert Mode.initial(auto=False, warmup_steps=0) is Mode.RUN
    assert Mode.WARMUP.to(Mode.RUN) is Mode.RUN and Mode.RUN.to(Mode.OBSERVE) is Mode.OBSERVE
    assert all(Mode.FALLBACK in TRANSITIONS[m] for m in Mode)  # the guard may stop any mode
    with pytest.raises(ValueError, match="from fallback to run"):
        Mode.FALLBACK.to(Mode.RUN)  # one-way
    with pytest.raises(ValueError, match="from warmup to observe"):
        Mode.WARMUP.to(Mode.OBSERVE)
    assert Mode.RUN == "run" and Mode.RUN.uncompressed is False and Mode.OBSERVE.uncompressed


def test_every_handle_has_the_whole_protocol():
    import slipstream.sync as sync
    from slipstream.sync import AllreduceState
    from slipstream.sync.hooks import HookSync

    wanted = [n for n in dir(sync.SyncHandle) if not n.startswith("_")]
    assert {"stats", "state_dict", "load_state_dict", "observe_loss", "request_probe", "decision_summary",
            "close"} <= set(wanted)
    for cls in (AllreduceState, HookSync):
        assert all(callable(getattr(cls, n)) for n in wanted if n != "name"), cls
