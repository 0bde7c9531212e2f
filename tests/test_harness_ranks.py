"""tests/harness.py's ranks: forked from a server that imported torch once, yet given what the
caller has at the call (its environment, its stdout/stderr), as ``spawn`` gave them."""

from __future__ import annotations

import os
import sys

from tests.harness import run_ranks


def _report(rank: int, world_size: int) -> dict:
    print(f"rank {rank} says hello on stderr", file=sys.stderr, flush=True)
    return {
        "mine": os.environ.get("SLIPSTREAM_HARNESS_PROBE"),
        "rank_env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "dynamo_preloaded": "torch._dynamo" in sys.modules,  # only the forkserver imports it
        "cwd": os.getcwd(),
    }


def test_ranks_get_the_callers_environment_output_and_directory(monkeypatch, capfd, tmp_path):
    run_ranks(_report, 2)  # the server is running before anything below is set
    capfd.readouterr()
    monkeypatch.setenv("SLIPSTREAM_HARNESS_PROBE", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    seen = run_ranks(_report, 2)
    assert [s["mine"] for s in seen] == ["set-after-the-server-started"] * 2
    assert [s["rank_env"] for s in seen] == [("0", "2"), ("1", "2")]
    assert all(s["cwd"] == str(tmp_path) for s in seen)
    err = capfd.readouterr().err
    assert "rank 0 says hello on stderr" in err and "rank 1 says hello on stderr" in err


def test_ranks_start_with_the_preloaded_imports():
    """The point of the forkserver: a rank does not import torch._dynamo (1.9 s of CPU) again."""
    assert all(s["dynamo_preloaded"] for s in run_ranks(_report, 2))
