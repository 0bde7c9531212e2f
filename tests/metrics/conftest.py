"""Fixtures for the metrics tests: one 2-rank gloo run shared by the distributed and report tests."""

from __future__ import annotations


import pytest

from tests.metrics.metrics_workers import LOG_EVERY, SLEEP_S, STEPS


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory):
    """A control run (no delay) and a straggler run (rank 1 sleeps in forward), 2 gloo ranks."""
    from tests.harness import run_ranks
    from tests.metrics.metrics_workers import train_twice

    base = tmp_path_factory.mktemp("two_rank")
    results = run_ranks(train_twice, 2, str(base), STEPS, LOG_EVERY, SLEEP_S, timeout_s=170)
    return {"base": str(base), "results": results}
