"""scripts/build_image.sh's bad inputs: one line naming the problem, exit 2, before any build (no engine needed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def build(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "build_image.sh"), *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("args, message", [
    (["--base", "debian:12", "--local-base"], "--base and --local-base exclude each other"),
    (["--torch-index", "https://x", "--torch-wheels", "/tmp"], "--torch-index and --torch-wheels exclude each other"),
    (["--torch-wheels", "/nonexistent-wheels"], "--torch-wheels: no such directory: /nonexistent-wheels"),
    (["--tag"], "--tag needs a name"),
    (["--frobnicate"], "unknown option --frobnicate"),
])
def test_bad_options_are_one_line_and_exit_2(args, message):
    proc = build(*args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_torch_wheels_without_a_torch_wheel(tmp_path):
    proc = build("--torch-wheels", str(tmp_path))
    assert proc.returncode == 2 and f"no torch-2.13.0*.whl in {tmp_path}" in proc.stderr, proc.stderr


def test_no_docker_engine_is_one_line_and_exit_2(tmp_path):
    proc = build(env={"DOCKER_HOST": f"unix://{tmp_path}/no-engine.sock"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert ("no Docker engine reachable" in proc.stderr and "scripts/docker_engine.sh start" in proc.stderr) \
        or "no docker command" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
