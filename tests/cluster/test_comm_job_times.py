"""benchmarks/comm_job_times.py: every comm-thread job of a compressed step is timed, in order."""

from __future__ import annotations

import pytest

from benchmarks import comm_job_times

pytestmark = pytest.mark.distributed


def test_jobs_are_timed_in_bucket_order():
    r = comm_job_times.measure("powersgd", "mlp", steps=12, bucket_mb=5.0)
    assert r["strategy"] == "powersgd" and r["median_step_ms"] > r["median_backward_ms"] > 0
    assert len(r["jobs"]) == 2 and all(len(step) >= 2 for step in r["jobs"]), r["jobs"]  # 33.6 MB in 5 MiB buckets
    for step in r["jobs"]:
        for j in step:
            assert j["submit_ms"] <= j["start_ms"] <= j["end_ms"], j
        # One thread, first in first out: each job starts after the one before it ended.
        assert all(a["end_ms"] <= b["start_ms"] for a, b in zip(step, step[1:])), step


def test_too_few_steps_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        comm_job_times.main(["--steps", "3"])
    assert e.value.code == 2 and "--steps must be >= 12" in capsys.readouterr().err
