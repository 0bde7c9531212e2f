"""Start-up time of the `slipstream` command, against `python -c pass` (issue #15 item 4).

Each command runs N times in a fresh interpreter, the cases interleaved; reported: the median
wall time and the median CPU time (user + system of the child: the robust figure on a shared
machine, where others' load stretches wall time). The commands that need no torch should stay
under 0.5 s. The last rows import torch, for scale.

    python3 benchmarks/cli_startup.py [--runs 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
JOBS = REPO / "examples" / "jobs"

CASES = [
    ("python -c pass", [PY, "-c", "pass"]),
    ("slipstream --help", [PY, "-m", "slipstream", "--help"]),
    ("slipstream validate examples/jobs/full.yaml", [PY, "-m", "slipstream", "validate", str(JOBS / "full.yaml")]),
    ("slipstream validate --spec-only examples/jobs/full.yaml",
     [PY, "-m", "slipstream", "validate", "--spec-only", str(JOBS / "full.yaml")]),
    ("slipstream render examples/jobs/local-2x1.yaml", [PY, "-m", "slipstream", "render", str(JOBS / "local-2x1.yaml")]),
    ("slipstream plan --help", [PY, "-m", "slipstream", "plan", "--help"]),
    ("slipstream plan --model gpt-1.3b --gpus 16 --gpu-type a100 --network 100gbit-ib",
     [PY, "-m", "slipstream", "plan", "--model", "gpt-1.3b", "--gpus", "16", "--gpu-type", "a100",
      "--network", "100gbit-ib"]),
    ("python -c 'import torch'", [PY, "-c", "import torch"]),
    ("python -c 'import slipstream; slipstream.accelerate'", [PY, "-c", "import slipstream; slipstream.accelerate"]),
]


def time_once(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    rows = []
    for _, argv in CASES:  # warm the page cache once, untimed
        time_once(argv)
    wall: dict[str, list[float]] = {name: [] for name, _ in CASES}
    cpu: dict[str, list[float]] = {name: [] for name, _ in CASES}
    for _ in range(args.runs):  # interleaved, so every case sees the same machine load
        for name, argv in CASES:
            w, c = time_once(argv)
            wall[name].append(w)
            cpu[name].append(c)
    base_w, base_c = statistics.median(wall[CASES[0][0]]), statistics.median(cpu[CASES[0][0]])
    print(f"| command (median of {args.runs}) | wall (s) | CPU (s) | CPU minus `python -c pass` (s) |")
    print("|---|---|---|---|")
    for name, _ in CASES:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        rows.append({"command": name, "wall_s": w, "cpu_s": c, "cpu_over_python_s": c - base_c,
                     "wall_runs_s": wall[name], "cpu_runs_s": cpu[name]})
        print(f"| `{name}` | {w:.3f} | {c:.3f} | {c - base_c:+.3f} |")
    del base_w
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
