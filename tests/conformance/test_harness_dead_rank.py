"""The rank-spawning harness fails at once when a rank dies without reporting (the matrix relies on it
to move past a row that crashed or hung a rank, instead of waiting out the whole timeout)."""

from __future__ import annotations

import os
import time

import pytest

from tests.harness import run_ranks


def die_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)  # no report on the queue, as a crash or faulthandler's exit leaves it
    time.sleep(60)
    return rank


def test_a_rank_that_dies_without_a_report_fails_the_run_at_once():
    started = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 failed:\nexited with code 3 without reporting a result"):
        run_ranks(die_on_rank_1, 2, timeout_s=50)
    assert time.monotonic() - started < 40
