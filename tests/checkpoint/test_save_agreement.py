"""should_save agrees only when it has to (issue #32, item 6).

The interval (every_steps) is the same number on every rank and needs no
agreement; the clock (every_s) and a stop request (SIGTERM, which may reach one
rank alone) do. They are agreed on agreement steps only, about every
``stop_check_s``, so a step between them runs no host collective; every rank
still takes the same branch at every step.
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def _loop(rank: int, world: int, directory: str, steps: int, stop_at: int, step_s: float, options: dict) -> dict:
    """``steps`` calls of should_save (``step_s`` apart), rank 1 alone asking to stop at ``stop_at``:
    the decisions that were not (False, False), the all-reduces it ran, and its time per step."""
    from slipstream.checkpoint.manager import CheckpointManager

    mgr = CheckpointManager(directory, handle_sigterm=False, **options)
    calls = {"n": 0}
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if kwargs.get("group") is mgr.group:
            calls["n"] += 1
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    decisions = []
    started = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            if rank == 1 and step == stop_at:
                mgr.preempt_requested = True  # what the SIGTERM handler sets, on this rank alone
            save, preempted = mgr.should_save(step)
            if save or preempted:
                decisions.append((step, save, preempted))
            if step_s:
                time.sleep(step_s)
        elapsed = time.perf_counter() - started
    finally:
        dist.all_reduce = real
    mgr.close()
    return {"decisions": decisions, "collectives": calls["n"], "per_step_us": elapsed / steps * 1e6}


def _scenarios(rank: int, world: int, directory: str, scenarios: list) -> list:
    import slipstream

    slipstream.init()
    out = [_loop(rank, world, f"{directory}/{i}", *scenario) for i, scenario in enumerate(scenarios)]
    slipstream.shutdown()
    return out


def test_steps_that_cannot_save_run_no_collective_and_a_stop_is_agreed(tmp_path):
    fast = (400, 150, 0.0, {"every_steps": 100})
    # With 50 ms steps and stop_check_s=0.2 the ranks agree at least every 4 steps.
    slow = (24, 9, 0.05, {"stop_check_s": 0.2})
    per_rank = run_ranks(_scenarios, 2, str(tmp_path), [fast, slow], timeout_s=120)

    results = [mine[0] for mine in per_rank]
    assert results[0]["decisions"] == results[1]["decisions"]  # the same branch on every rank, every step
    decisions = results[0]["decisions"]
    assert decisions[0] == (100, True, False), decisions  # the interval, without any agreement needed
    first_stop = next(step for step, _, preempted in decisions if preempted)
    # Rank 1's stop request is seen by both at the first agreement step after it: at most
    # STOP_CHECK_MAX_STEPS (100) steps later, and at step 200 at the latest (a save is due).
    assert 150 <= first_stop <= 200, decisions
    assert all(save and preempted for step, save, preempted in decisions if step >= first_stop), decisions
    for done in results:  # was one all-reduce every step (400)
        assert done["collectives"] <= 400 // 10, done

    results = [mine[1] for mine in per_rank]
    assert results[0]["decisions"] == results[1]["decisions"]
    first_stop = results[0]["decisions"][0][0]
    assert 9 <= first_stop <= 9 + 4, results[0]["decisions"]  # (a loaded machine, slower steps: sooner)


def test_a_bad_stop_check_interval_is_refused(tmp_path):
    from slipstream.checkpoint.manager import CheckpointManager
    from slipstream.errors import ConfigError

    with pytest.raises(ConfigError, match=r"stop_check_s must be > 0 and below preemption_deadline_s \(25.0\), got 30"):
        CheckpointManager(str(tmp_path), handle_sigterm=False, stop_check_s=30)
