"""Run a rendered sbatch script with bash, on this machine, without Slurm.

``srun`` is a shim that drops its ``--options`` and runs the rest (one task, here);
``scontrol`` answers the two questions the script asks; ``slipstream`` is a stand-in
program that records its argv and environment as bytes (hex, in JSON lines). So the
script's own quoting (its exports, the ``bash -c`` launch line, the prewarm line) runs
as written and what arrives is what a real node's agent would receive.

Example::

    calls = run_sbatch_script(render_sbatch(spec), tmp_path)
    agent = next(c for c in calls if c["argv"][0] == "run")   # argv, env: str
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SRUN = """#!/bin/bash
while [ "$#" -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
SCONTROL = """#!/bin/bash
case "$2" in
  hostnames) echo n1 ;;
  node) echo "NodeName=$3 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=$3 State=IDLE" ;;
esac
"""
STANDIN = f"""#!{sys.executable} -IS
import json, os, sys
rec = {{"argv": [os.fsencode(a).hex() for a in sys.argv[1:]],
        "env": {{k.hex(): v.hex() for k, v in os.environb.items()}}}}
with open(os.environ["STANDIN_OUT"], "a") as fh:
    fh.write(json.dumps(rec) + "\\n")
"""


def _decode(hexed: str) -> str:
    return bytes.fromhex(hexed).decode("utf-8", "surrogateescape")


def run_sbatch_script(script: str, tmp_path: Path, timeout_s: float = 60) -> list[dict]:
    """Run ``script`` with bash as a one-node allocation's batch shell; returns the stand-in's
    calls in order, each ``{"argv": [...], "env": {...}}`` (the bytes decoded as UTF-8)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("slipstream", STANDIN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "calls.jsonl"
    out.unlink(missing_ok=True)
    (tmp_path / "script.sbatch").write_bytes(script.encode("utf-8"))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STANDIN_OUT": str(out), "SLURM_JOB_ID": "7",
           "SLURM_CPUS_PER_TASK": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0", "SLURMD_NODENAME": "n1",
           "SLURM_SUBMIT_DIR": str(tmp_path), "LANG": "C.UTF-8"}
    proc = subprocess.run(["bash", str(tmp_path / "script.sbatch")], env=env, cwd=tmp_path, capture_output=True,
                          timeout=timeout_s, check=False)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    calls = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return [{"argv": [_decode(a) for a in c["argv"]], "env": {_decode(k): _decode(v) for k, v in c["env"].items()}}
            for c in calls]


def agent_call(calls: list[dict]) -> dict:
    """The ``slipstream run`` call (the node's agent)."""
    runs = [c for c in calls if c["argv"][:1] == ["run"]]
    assert len(runs) == 1, calls
    return runs[0]


__all__ = ["run_sbatch_script", "agent_call"]
