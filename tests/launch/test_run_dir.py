"""The run directory the launcher settles before workers start (the flight recorder's dumps and
the hang verdict meet there; issue #32)."""

from __future__ import annotations

import os
import time

from slipstream.launch.api import LaunchOptions, with_run_dir


def test_a_default_run_dir_is_chosen_before_the_workers_start(monkeypatch, tmp_path):
    monkeypatch.delenv("SLIPSTREAM_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    now = time.mktime((2026, 12, 2, 4, 31, 0, 0, 0, -1))
    got = with_run_dir(LaunchOptions("t.py"), now=now).worker_env["SLIPSTREAM_RUN_DIR"]
    assert got == os.path.join(str(tmp_path), "runs", "20261202-043100")


def test_several_nodes_with_one_rendezvous_id_agree_on_it(monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_RUN_DIR", raising=False)
    opts = LaunchOptions("t.py", min_nodes=2, max_nodes=2, rdzv_endpoint="h:1", rdzv_id="job/42")
    assert with_run_dir(opts).worker_env["SLIPSTREAM_RUN_DIR"].endswith(os.path.join("runs", "job_42"))


def test_a_chosen_run_dir_stands(monkeypatch):
    opts = LaunchOptions("t.py", worker_env={"SLIPSTREAM_RUN_DIR": "mine"})
    assert with_run_dir(opts) is opts
    monkeypatch.setenv("SLIPSTREAM_RUN_DIR", "/launcher/env")
    assert "SLIPSTREAM_RUN_DIR" not in with_run_dir(LaunchOptions("t.py")).worker_env  # the workers inherit it


def test_launch_leaves_the_callers_environment_as_it_was(monkeypatch, tmp_path):
    """In-process launch() builds the workers' environment in os.environ: a second launch in the
    same process (a notebook, a test) must not inherit the first one's training options."""
    import os

    from slipstream.launch import LaunchOptions, launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLIPSTREAM_SYNC", raising=False)
    monkeypatch.chdir(tmp_path)
    before = dict(os.environ)
    code = launch(LaunchOptions("true", [], nproc_per_node=1, no_python=True,
                                worker_env={"SLIPSTREAM_SYNC": "bf16", "SLIPSTREAM_RUN_DIR": str(tmp_path / "run")}))
    assert code == 0
    assert dict(os.environ) == before
