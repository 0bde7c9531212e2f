"""Start-up time of the `slipstream` command, against `python -c pass` (issue #15 item 4).

Each command runs N times in a fresh interpreter (median wall time reported); the commands
that need no torch should stay under 0.5 s. The last rows import torch, for scale.

    python3 benchmarks/cli_startup.py [--runs 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
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


def time_once(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", metavar="OUT")
    args = ap.parse_args()
    rows = []
    for _, argv in CASES:  # warm the page cache once, untimed
        time_once(argv)
    times: dict[str, list[float]] = {name: [] for name, _ in CASES}
    for _ in range(args.runs):  # interleaved, so every case sees the same machine load
        for name, argv in CASES:
            times[name].append(time_once(argv))
    base = statistics.median(times[CASES[0][0]])
    print(f"| command | median of {args.runs} (s) | minus `python -c pass` (s) |")
    print("|---|---|---|")
    for name, _ in CASES:
        med = statistics.median(times[name])
        rows.append({"command": name, "median_s": med, "over_python_s": med - base, "runs_s": times[name]})
        print(f"| `{name}` | {med:.3f} | {med - base:+.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
