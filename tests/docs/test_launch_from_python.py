"""docs/launcher.md, "From Python or a notebook": the two blocks run as printed (issue #46 item 10),
the script written where the notebook's %%writefile writes it and the launch cell run in a fresh
interpreter in that directory."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "launcher.md"

pytestmark = pytest.mark.distributed


def _blocks() -> tuple[str, str]:
    text = PAGE.read_text()
    section = text[text.index("## From Python or a notebook"):]
    blocks = re.findall(r"^```python\n(.*?)^```", section, flags=re.S | re.M)
    assert len(blocks) == 2, blocks
    script, cell = blocks
    assert script.startswith("%%writefile train.py\n")
    return script.split("\n", 1)[1], cell


def test_the_documented_launch_runs_two_ranks_and_returns_zero(tmp_path):
    script, cell = _blocks()
    (tmp_path / "train.py").write_text(script)
    proc = subprocess.run([sys.executable, "-c", cell], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "exit code 0" in proc.stdout, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2: 5 steps" in out, out[-3000:]
    assert (tmp_path / "runs" / "notebook" / "metrics").is_dir(), sorted(p.name for p in tmp_path.rglob("*"))
