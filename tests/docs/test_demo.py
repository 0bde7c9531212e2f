"""The demo says where its run directory is when it starts, with the report command (at the end,
`slipstream run` says it for every script: tests/launch/test_summary.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_demo_prints_its_run_directory_and_the_report_command(tmp_path):
    run_dir = tmp_path / "run"
    tiny = ["--steps", "2", "--layers", "1", "--dim", "32", "--batch-size", "2", "--context", "16",
            "--corpus-mb", "0.05", "--data-cache", str(tmp_path / "cache")]
    proc = subprocess.run([sys.executable, "examples/train_gpt.py", *tiny], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "SLIPSTREAM_RUN_DIR": str(run_dir)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    mentions = [i for i, line in enumerate(lines) if line.startswith("run directory: ") and str(run_dir) in line]
    done = next(i for i, line in enumerate(lines) if line.startswith("done: "))
    assert len(mentions) == 1 and mentions[0] < done, proc.stdout
    assert lines[mentions[0]].endswith(f"slipstream report {run_dir})")
    assert (run_dir / "metrics" / "rank0.jsonl").exists()  # the directory it names is the one written
