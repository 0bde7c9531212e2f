"""The training image's size and start-up: from ``docker run`` to the first training step.

Side by side, interleaved, N times each (medians reported):

* ``docker run --rm IMAGE --version``: the container and the CLI alone;
* ``docker run --rm IMAGE run -n 1 examples/train_gpt.py`` to its first logged step (step 1);
* the same ``slipstream run`` on the host, to the same line: what the container adds.

The first step line is read from the process's output as it comes (log every step), so the
time includes the container's start, the agent, the worker's imports, the data, the process
group and the first step. The image is built by ``scripts/build_image.sh`` beforehand.

    python3 benchmarks/container_startup.py --image slipstream:0.1.0-cpu [--runs 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["examples/train_gpt.py", "--steps", "3", "--dim", "32", "--layers", "1", "--context", "32",
         "--batch-size", "4", "--corpus-mb", "0.5"]
FIRST_STEP = r"step 1(?:/\d+)? \|"  # a regular expression: the log line reads "step 1/TOTAL |" when the total is known


def time_to_line(argv: list[str], line: str | None, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Seconds to the first output line matching the regular expression ``line`` (None: to the end), and to the end."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    seen = None
    assert proc.stdout is not None
    for text in proc.stdout:
        if seen is None and line is not None and re.search(line, text):
            seen = time.monotonic() - t0
    code = proc.wait()
    total = time.monotonic() - t0
    if code != 0 or (line is not None and seen is None):
        raise SystemExit(f"container_startup: {' '.join(argv)} exited {code} without {line!r}")
    return (seen if seen is not None else total), total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--image", required=True)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)

    size_bytes = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", args.image],
                                    capture_output=True, text=True, check=True).stdout)
    host_env = {**os.environ, "SLIPSTREAM_LOG_EVERY_STEPS": "1"}
    cases = {
        "docker run IMAGE --version (to exit)": (["docker", "run", "--rm", args.image, "--version"], None, None),
        "docker run IMAGE run -n 1 train_gpt.py (to step 1)": (
            ["docker", "run", "--rm", "-e", "SLIPSTREAM_LOG_EVERY_STEPS=1", args.image, "run", "-n", "1", *TRAIN],
            FIRST_STEP, None),
        "host: slipstream run -n 1 train_gpt.py (to step 1)": (
            [sys.executable, "-m", "slipstream", "run", "-n", "1", *TRAIN], FIRST_STEP, host_env),
    }
    for argv_, line, env in cases.values():  # warm: the corpus cache on the host, the page cache
        time_to_line(argv_, line, env)
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.runs):
        for name, (argv_, line, env) in cases.items():
            seconds[name].append(time_to_line(argv_, line, env)[0])
    medians = {name: statistics.median(v) for name, v in seconds.items()}
    print(f"image {args.image}: {size_bytes / 1e6:.0f} MB")
    print(f"{'case':<55} {'median s':>9}  runs")
    for name, v in seconds.items():
        print(f"{name:<55} {medians[name]:>9.2f}  {', '.join(f'{x:.2f}' for x in v)}")
    names = list(cases)
    print(f"container / host, to step 1: {medians[names[1]] / medians[names[2]]:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"image": args.image, "size_bytes": size_bytes,
                                               "seconds": seconds, "medians": medians}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
