"""The launcher's closing lines: a one-line summary and the run directory, for every run, whatever
the script prints; nothing after them on a run that succeeds (issue #46 items 4 and 8)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from slipstream.launch.summary import read_totals, summary_lines

REPO = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"^\[slipstream\] step \d+")


def readme_script(steps: int) -> str:
    """The README's converted script, as a user saves it, with fewer steps."""
    text = (REPO / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert "while run.step_count < 600:" in code
    return code.replace("while run.step_count < 600:", f"while run.step_count < {steps}:")


def lines_after_last_step(output: str) -> list[str]:
    lines = output.splitlines()
    last = max(i for i, line in enumerate(lines) if STEP_LINE.match(line))
    return lines[last + 1:]


def check_quiet_success(proc: subprocess.CompletedProcess, run_dir: Path, steps: int, ranks: int) -> None:
    """Exit 0; after the last step line only the summary and the run directory; no C++ warning
    (``[W...]`` lines), no traceback, no native frame anywhere."""
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    tail = lines_after_last_step(out)
    assert len(tail) == 2, tail
    assert tail[0].startswith(f"slipstream run: done: {steps} steps in ") and f"{ranks} rank(s)" in tail[0], tail
    assert tail[1] == f"slipstream run: run directory {run_dir} (see it with: slipstream report {run_dir})", tail
    for noise in ("Traceback", "frame #", "TCPStore.cpp", "socket.cpp"):
        assert noise not in out, out[-4000:]
    assert not [line for line in out.splitlines() if re.match(r"^\[?[WE]\d{4} ", line)], out[-4000:]


def test_a_local_run_of_the_readme_script_ends_with_its_summary_and_run_directory(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(readme_script(steps=20))
    run_dir = tmp_path / "runs" / "r"
    proc = subprocess.run([sys.executable, "-m", "slipstream", "run", "-n", "2", "--run-dir",
                           str(run_dir), str(script)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    check_quiet_success(proc, run_dir, steps=20, ranks=2)


def test_quiet_drops_the_notes_of_the_launcher_and_of_the_workers_but_not_their_warnings(tmp_path):
    script = tmp_path / "notes.py"
    script.write_text("import logging\nfrom slipstream.log import CONSOLE\n"
                      "log = logging.getLogger('slipstream.user')\n"
                      "log.info('a note', extra=CONSOLE)\nlog.warning('a warning')\nprint('trained')\n")
    quiet = subprocess.run([sys.executable, "-m", "slipstream", "run", "-n", "1", "--run-dir", str(tmp_path / "run"),
                            "-q", str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    # Without -q both notes are shown (a CONSOLE record is what print() said; the summary: the test above).
    assert "a note" not in quiet.stderr and "slipstream run:" not in quiet.stderr, quiet.stderr
    assert "a warning" in quiet.stderr and "trained" in quiet.stdout


def _write_metrics(run_dir: Path, records: list[dict], world_size: int = 2) -> None:
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "metrics" / "run.json").write_text(json.dumps({"world_size": world_size}))
    with open(run_dir / "metrics" / "rank0.jsonl", "w") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")
        fh.write('{"step": 3')  # a line cut short


def test_totals_count_the_last_run_in_the_directory_only(tmp_path):
    earlier = [{"step": 10, "time_s": 50.0, "loss": 9.0, "tokens": 999}]
    this = [{"step": 10, "time_s": 2.0, "loss": 3.0, "tokens": 100},
            {"step": 20, "time_s": 4.0, "loss": 2.5, "tokens": 100}]
    _write_metrics(tmp_path, earlier + this)
    totals = read_totals(str(tmp_path))
    assert (totals.steps, totals.train_s, totals.final_loss, totals.world_size) == (20, 4.0, 2.5, 2)
    assert totals.rate == 100.0 and totals.rate_unit == "tokens/s"  # 2 x 100 tokens x 2 ranks / 4 s


def test_summary_lines_for_success_failure_and_a_script_without_metrics(tmp_path):
    _write_metrics(tmp_path / "run", [{"step": 5, "time_s": 1.0, "loss": 0.5, "samples": 8}])
    ok = summary_lines(str(tmp_path / "run"), 0, 3.0)
    assert ok == ["slipstream run: done: 5 steps in 1.0 s of training (3.0 s in all), final loss 0.5000, "
                  "16 samples/s, 2 rank(s)",
                  f"slipstream run: run directory {tmp_path / 'run'} (see it with: slipstream report {tmp_path / 'run'})"]
    assert summary_lines(str(tmp_path / "run"), 1, 3.0) == ok[1:]  # a failure was reported already
    assert summary_lines(str(tmp_path / "none"), 0, 3.0) == [
        "slipstream run: done in 3.0 s (the script recorded no Slipstream metrics)"]
    os.makedirs(tmp_path / "empty")
    assert summary_lines(str(tmp_path / "empty"), 0, 1.0)[1] == f"slipstream run: run directory {tmp_path / 'empty'}"
