"""Goodput under repeated worker kills: disk checkpoints, in-memory snapshots and healing in place, side by side.

The GPT example under ``slipstream run -n W --max-restarts K``, a disk checkpoint every
``--every`` steps; a random worker is SIGKILLed every ``--period-s`` seconds of training
(counted from the first step, and from the first step after each recovery) until the job
ends. Each configuration runs in up to three modes, one after the other, same steps, same
kill period: ``disk`` (disk checkpoints only, every worker restarted), ``snapshots``
(``--snapshot-every-steps 1`` added: every worker restarted, back to the in-memory
snapshot) and ``heal`` (``--heal``: the survivors keep their processes, the dead rank's
supervisor starts a warm spare; the kill hits the rank's training process, whose pid the
supervisor writes to ``SLIPSTREAM_HEAL_PID_DIR``).

Per run: goodput (the time the counted steps take at the run's own median step time,
over the wall time from the first step to the last), steps redone per failure (the killed
rank's last step logged before the kill minus the step training resumed from),
fault-to-next-step time (the kill to the first step the killed rank's new process logs:
its metrics file gains a line only from a new process) and the median time a step spent in
the checkpoint phase (saves and snapshots: what they hold the loop). Every rank logs every
step (``--log-every-steps 1``).

    python -m benchmarks.goodput --worlds 2,4 --period-s 30,60 --steps 1500
    python -m benchmarks.goodput --worlds 2 --period-s 30 --steps 600     # about 5 minutes on 2 cores
    python -m benchmarks.goodput --modes disk,heal --worlds 2,4 --period-s 30 --steps 1000

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


MODES = ("disk", "snapshots", "heal")


def training_pid(agent_pid: int, rank: int, pid_dir: Path | None) -> int | None:
    """The process that trains for ``rank``: under --heal the one its supervisor names, else the worker."""
    if pid_dir is None:
        return worker_pid(agent_pid, rank)
    try:
        return int((pid_dir / f"rank{rank}.pid").read_text())
    except (OSError, ValueError):
        return None


def run_once(world: int, steps: int, every: int, period_s: float, mode: str, seed: int) -> dict:
    rng = random.Random(seed)
    snapshots = mode != "disk"
    with tempfile.TemporaryDirectory() as tmp:
        run_dir, ckpt = Path(tmp) / "run", Path(tmp) / "ckpt"
        pid_dir = Path(tmp) / "pids" if mode == "heal" else None
        env = dict(os.environ)
        if pid_dir is not None:
            pid_dir.mkdir()
            env["SLIPSTREAM_HEAL_PID_DIR"] = str(pid_dir)
        cmd = [sys.executable, "-m", "slipstream", "run", "-n", str(world), "--max-restarts", "100",
               "--run-dir", str(run_dir), "--log-every-steps", "1",
               *(["--snapshot-every-steps", "1"] if snapshots else []), *(["--heal"] if mode == "heal" else ["--no-heal"]),
               GPT, "--steps", str(steps), "--layers", "2", "--checkpoint-dir", str(ckpt),
               "--checkpoint-every-steps", str(every)]
        started = time.monotonic()
        agent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True, env=env)
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
                    # The killed rank's own file: a line added after the kill comes from its new process
                    # (the dead one cannot write), i.e. the first step after the fault. Rank 0's file is
                    # no clock for this: a survivor may still log the step it finished as the peer died.
                    mine = records(pending["file"])
                    if len(mine) > pending["lines"]:
                        rec = mine[pending["lines"]]
                        pending["fault_to_next_step_s"] = now - pending["killed_at"]
                        pending["resumed_from"] = rec["step"] - 1
                        pending["redone"] = max(0, pending["last_step"] - pending["resumed_from"])
                        failures.append({k: v for k, v in pending.items() if k != "file"})
                        pending = None
                        next_kill = now + period_s
                if arrivals and next_kill is None and pending is None:
                    next_kill = now + period_s
                if next_kill is not None and pending is None and now >= next_kill:
                    rank = rng.randrange(world)
                    pid = training_pid(agent.pid, rank, pid_dir)
                    if pid is not None:
                        file = run_dir / "metrics" / f"rank{rank}.jsonl"
                        os.kill(pid, signal.SIGKILL)
                        before = records(file)  # read after: every line from here on is a new process's
                        pending = {"rank": rank, "killed_at": time.monotonic(), "file": file, "lines": len(before),
                                   "last_step": before[-1]["step"] if before else arrivals[-1][1]}
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
            "world": world, "mode": mode, "snapshots": snapshots, "period_s": period_s, "steps": steps, "every": every,
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
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)} (default all)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for period in [float(t) for t in args.period_s.split(",")]:
            for mode in modes:
                row = run_once(world, args.steps, args.every, period, mode, args.seed)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "failure_list"}), flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}\n")
    print("| ranks | kill every | recovers from | exit | failures | goodput | steps redone per failure | "
          "fault to next step (median / max) | checkpoint phase per step (median) | step (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        source = {"disk": f"disk (every {r['every']} steps), all restart",
                  "snapshots": "in-memory snapshot (every step), all restart",
                  "heal": "in-memory snapshot (every step), healed in place (warm spare)"}[r["mode"]]
        print(f"| {r['world']} | {r['period_s']:.0f} s | {source} | {r['exit_code']} | {r['failures']} | "
              f"{r['goodput']:.2f} | {r['redone_per_failure']:.1f} | {r['fault_to_next_step_median_s']:.1f} / "
              f"{r['fault_to_next_step_max_s']:.1f} s | {r['checkpoint_phase_median_ms']:.1f} ms | "
              f"{r['median_step_s'] * 1000:.0f} ms |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
