"""The spec's words and env through a real sbatch, srun and node (scripts/slurm_cluster.sh), byte for byte.

The rendered script is submitted as it is; only ``slipstream`` on the job's PATH is a stand-in that
records its argv and environment (tests/job/sbatch_shim.py), so real srun carries what the script's
quoting made. Seconds: one one-node job, no torch.
"""

from __future__ import annotations

import json
import subprocess
import time

from slipstream.job import parse_spec
from slipstream.job.slurm import render_sbatch
from tests.job.sbatch_shim import STANDIN


def test_words_and_env_arrive_unchanged_through_srun(slurm_env, tmp_path):
    marker = tmp_path / "ran"
    words = [f"$(touch {marker})", f"${{HOME}}`touch {marker}`", "a\nb 'c' \"d\" \\e", "é中😀\x01\x7f", "$(OUT)/x",
             "$$(OUT)", "$(NOPE"]
    spec = parse_spec({"name": "words", "image": "img:1", "command": ["python3", "train.py", *words],
                       "env": {"OUT": "/o u\nt", "LOG": "$(OUT)/log;`id`"}})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "slipstream").write_text(STANDIN)
    (bin_dir / "slipstream").chmod(0o755)
    out = tmp_path / "calls.jsonl"
    env = {**slurm_env, "PATH": f"{bin_dir}:{slurm_env['PATH']}", "STANDIN_OUT": str(out)}
    proc = subprocess.run(["sbatch", "--parsable"], input=render_sbatch(spec), env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().split(";")[0]
    deadline, state = time.monotonic() + 120, ""
    while time.monotonic() < deadline:  # an event (the job's end), with a generous deadline
        show = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True,
                              timeout=30, check=False).stdout
        state = next((f.split("=", 1)[1] for f in show.split() if f.startswith("JobState=")), "")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            break
        time.sleep(0.2)
    log = next(tmp_path.glob("slipstream-words-*.out")).read_text(errors="replace")
    assert state == "COMPLETED", log
    assert not marker.exists(), "the job ran code from the spec"
    (call,) = [json.loads(line) for line in out.read_text().splitlines()]
    argv = [bytes.fromhex(a).decode() for a in call["argv"]]
    got_env = {bytes.fromhex(k).decode(): bytes.fromhex(v).decode() for k, v in call["env"].items()}
    assert argv[0] == "run" and argv[-len(words) - 1:] == [
        "train.py", *words[:4], "/o u\nt/x", "$(OUT)", "$(NOPE"]
    assert got_env["OUT"] == "/o u\nt" and got_env["LOG"] == "/o u\nt/log;`id`"
