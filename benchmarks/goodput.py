"""Goodput under repeated worker kills: disk checkpoints only against in-memory snapshots, side by side.

The GPT example under ``slipstream run -n W --max-restarts K``, a disk checkpoint every
``--every`` steps; a random worker is SIGKILLed every ``--period-s`` seconds of training
(counted from the first step, and from the first step after each recovery) until the job
ends. Each configuration runs once with disk checkpoints only and once with
``--snapshot-every-steps 1`` added, one after the other, same steps, same kill period.

Per run: goodput (the time the counted steps take at the run's own median step time,
over the wall time from the first step to the last), steps redone per failure (last step
logged before the kill minus the step training resumed from), fault-to-next-step time
(the kill to the first step logged after it) and the median time a step spent in the
checkpoint phase (saves and snapshots: what they hold the loop).

    python -m benchmarks.goodput --worlds 2,4 --period-s 30,60 --steps 1500
    python -m benchmarks.goodput --worlds 2 --period-s 30 --steps 600     # about 5 minutes on 2 cores

Not measured here: torchft side by side (its wheel installs from the index, but its
training loop is a different program; see BENCHMARKS.md for what that would take).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from recovery import GPT, worker_pid  # noqa: E402 - run as a script or a module


def records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def run_once(world: int, steps: int, every: int, period_s: float, snapshots: bool, seed: int) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, ckpt = Path(tmp) / "run", Path(tmp) / "ckpt"
        cmd = [sys.executable, "-m", "slipstream", "run", "-n", str(world), "--max-restarts", "100",
               "--run-dir", str(run_dir), "--log-every-steps", "1",
               *(["--snapshot-every-steps", "1"] if snapshots else []),
               GPT, "--steps", str(steps), "--layers", "2", "--checkpoint-dir", str(ckpt),
               "--checkpoint-every-steps", str(every)]
        started = time.monotonic()
        agent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
        log = run_dir / "metrics" / "rank0.jsonl"
        arrivals: list[tuple[float, int]] = []  # (wall time seen, step) of every step line, redone ones too
        failures: list[dict] = []
        next_kill = None
        pending = None  # the kill whose recovery is awaited
        try:
            while agent.poll() is None:
                now = time.monotonic()
                seen = records(log)
                for rec in seen[len(arrivals):]:
                    arrivals.append((now, rec["step"]))
                    if pending is not None:
                        pending["fault_to_next_step_s"] = now - pending["killed_at"]
                        pending["resumed_from"] = rec["step"] - 1
                        # Steps run again; a snapshot newer than rank 0's last line (it logs after) redoes none.
                        pending["redone"] = max(0, pending["last_step"] - pending["resumed_from"])
                        failures.append(pending)
                        pending = None
                        next_kill = now + period_s
                if arrivals and next_kill is None and pending is None:
                    next_kill = now + period_s
                if next_kill is not None and pending is None and now >= next_kill:
                    rank = rng.randrange(world)
                    pid = worker_pid(agent.pid, rank)
                    if pid is not None:
                        last = arrivals[-1][1]
                        os.kill(pid, signal.SIGKILL)
                        pending = {"rank": rank, "killed_at": time.monotonic(), "last_step": last}
                        next_kill = None
                time.sleep(0.02)
            code = agent.wait()
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
        final = records(log)
        for rec in final[len(arrivals):]:
            arrivals.append((time.monotonic(), rec["step"]))
        step_times = [r["step_time_s"] for r in final if "step_time_s" in r]
        held = [r["checkpoint_s"] for r in final if "checkpoint_s" in r]
        median_step = statistics.median(step_times) if step_times else float("nan")
        window = arrivals[-1][0] - arrivals[0][0] if len(arrivals) > 1 else float("nan")
        counted = arrivals[-1][1] - arrivals[0][1] if arrivals else 0
        return {
            "world": world, "snapshots": snapshots, "period_s": period_s, "steps": steps, "every": every,
            "exit_code": code, "wall_s": time.monotonic() - started, "failures": len(failures),
            "goodput": counted * median_step / window if window == window and window > 0 else float("nan"),
            "median_step_s": median_step,
            "redone_per_failure": statistics.mean(f["redone"] for f in failures) if failures else 0.0,
            "fault_to_next_step_median_s": statistics.median(f["fault_to_next_step_s"] for f in failures)
            if failures else float("nan"),
            "fault_to_next_step_max_s": max((f["fault_to_next_step_s"] for f in failures), default=float("nan")),
            "checkpoint_phase_median_ms": statistics.median(held) * 1000 if held else float("nan"),
            "failure_list": failures,
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2", help="comma-separated world sizes (default 2)")
    p.add_argument("--period-s", default="30", help="comma-separated kill periods in seconds (default 30)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=50, help="disk checkpoint interval in steps (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for period in [float(t) for t in args.period_s.split(",")]:
            for snapshots in (False, True):
                row = run_once(world, args.steps, args.every, period, snapshots, args.seed)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "failure_list"}), flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}\n")
    print("| ranks | kill every | recovers from | exit | failures | goodput | steps redone per failure | "
          "fault to next step (median / max) | checkpoint phase per step (median) | step (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        source = "in-memory snapshot (every step)" if r["snapshots"] else f"disk (every {r['every']} steps)"
        print(f"| {r['world']} | {r['period_s']:.0f} s | {source} | {r['exit_code']} | {r['failures']} | "
              f"{r['goodput']:.2f} | {r['redone_per_failure']:.1f} | {r['fault_to_next_step_median_s']:.1f} / "
              f"{r['fault_to_next_step_max_s']:.1f} s | {r['checkpoint_phase_median_ms']:.1f} ms | "
              f"{r['median_step_s'] * 1000:.0f} ms |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
