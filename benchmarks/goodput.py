"""Goodput under repeated worker kills: healing in place, the full restart and torchft, side by side.

The GPT example under ``slipstream run -n W --max-restarts K``, a disk checkpoint every
``--every`` steps, in the layout ``ddp`` (data parallel) or ``dp_shard`` (FSDP2 over the W
ranks: the example's ``--dp-shard W``); a random worker is SIGKILLed every
``--kill-every-s`` seconds of training (counted from the first step, and from the first step
after each recovery) until the job ends. Each configuration runs in the chosen modes, one
after the other, same steps, same kill period:

* ``heal``: healing in place as a user gets it (the survivors keep their processes, the dead
  rank's supervisor starts a warm spare; the kill hits the rank's training process, whose pid
  the supervisor writes to ``SLIPSTREAM_HEAL_PID_DIR``): no flag where healing is on by default
  (the launcher knows ``--no-heal``), else ``--heal``. A layout that cannot heal says so at
  start and restarts: the row's ``heals`` counts the deaths that did heal in place;
* ``disk``: today's restart path, disk checkpoints only, every worker restarted (``--no-heal``
  where the launcher has it);
* ``snapshots``: the restart path with ``--snapshot-every-steps 1`` (back to the in-memory
  snapshot, every worker restarted);
* ``torchft``: ``benchmarks/torchft_goodput.py`` at W replicas (its own loop on the same GPT;
  ``ddp`` only: torchft's replicas are data parallel), when torchft is installed (the bench
  group: ``scripts/install.sh bench``); left out with a line otherwise.

Per run: goodput (the time the counted steps take at the run's own median step time,
over the wall time from the first step to the last), steps redone per failure (the killed
rank's last step logged before the kill minus the step training resumed from),
fault-to-next-step time (the kill to the first step the killed rank's new process logs:
its metrics file gains a line only from a new process) and the median time a step spent in
the checkpoint phase (saves and snapshots: what they hold the loop). Every rank logs every
step (``--log-every-steps 1``). The table ends with issue #43's targets for the heal rows:
goodput at least 0.95, fault to next step at most 0.6 s median and 2 s at most, goodput above
torchft's at the same size.

    python -m benchmarks.goodput --layouts ddp,dp_shard   # issue #43's table: 2 and 4 ranks, 3000 steps, every 30 s
    python -m benchmarks.goodput --worlds 2 --layouts ddp --steps 300 --kill-every-s 10   # the short form
    python -m benchmarks.goodput --modes disk,snapshots,heal --worlds 2 --steps 600
"""

from __future__ import annotations

import argparse
import importlib.util
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


class Tail:
    """The complete records a JSONL file gained since the last call: only the bytes added are read.
    The runs' monitors poll every 20 ms; parsing the whole file each time took a core of the two
    here by the end of a 3000-step run and slowed the run it measured."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.rest = path, 0, b""

    def new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                if os.fstat(fh.fileno()).st_size < self.offset:  # written anew: read it from the start
                    self.offset, self.rest = 0, b""
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")  # the last piece: a line being written
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


MODES = ("heal", "disk", "snapshots", "torchft")
LAYOUTS = ("ddp", "dp_shard")


def healing_is_default() -> bool:
    """Whether ``slipstream run`` heals with no flag (it then has ``--no-heal`` to opt out)."""
    out = subprocess.run([sys.executable, "-m", "slipstream", "run", "--help"], cwd=REPO, capture_output=True,
                         text=True).stdout
    return "--no-heal" in out


def heal_flags(mode: str, heal_default: bool) -> list[str]:
    """The launcher's options that select ``mode``'s recovery."""
    if mode == "heal":
        return [] if heal_default else ["--heal"]
    return ["--no-heal"] if heal_default else []


def training_pid(agent_pid: int, rank: int, pid_dir: Path | None) -> int | None:
    """The process that trains for ``rank``: under --heal the one its supervisor names, else the worker."""
    if pid_dir is None:
        return worker_pid(agent_pid, rank)
    try:
        return int((pid_dir / f"rank{rank}.pid").read_text())
    except (OSError, ValueError):
        return None


def run_once(world: int, steps: int, every: int, period_s: float, mode: str, seed: int, layout: str = "ddp",
             heal_default: bool = False) -> dict:
    rng = random.Random(seed)
    snapshots = mode != "disk"
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "launcher.log"
        run_dir, ckpt = Path(tmp) / "run", Path(tmp) / "ckpt"
        pid_dir = Path(tmp) / "pids" if mode == "heal" else None
        env = dict(os.environ)
        if pid_dir is not None:
            pid_dir.mkdir()
            env["SLIPSTREAM_HEAL_PID_DIR"] = str(pid_dir)
        cmd = [sys.executable, "-m", "slipstream", "run", "-n", str(world), "--max-restarts", "100",
               "--run-dir", str(run_dir), "--log-every-steps", "1",
               *(["--snapshot-every-steps", "1"] if snapshots else []), *heal_flags(mode, heal_default),
               GPT, "--steps", str(steps), "--layers", "2", "--checkpoint-dir", str(ckpt),
               "--checkpoint-every-steps", str(every), *(["--dp-shard", str(world)] if layout == "dp_shard" else [])]
        started = time.monotonic()
        with open(output, "w") as fh:
            agent = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=env)
        log = run_dir / "metrics" / "rank0.jsonl"
        rank0 = Tail(log)
        arrivals: list[tuple[float, int]] = []  # (wall time seen, step) of every step line, redone ones too
        failures: list[dict] = []
        next_kill = None
        pending = None  # the kill whose recovery is awaited
        try:
            while agent.poll() is None:
                now = time.monotonic()
                for rec in rank0.new():
                    arrivals.append((now, rec["step"]))
                if pending is not None:
                    # The killed rank's own file: a line added after the kill comes from its new process
                    # (the dead one cannot write), i.e. the first step after the fault. Rank 0's file is
                    # no clock for this: a survivor may still log the step it finished as the peer died.
                    mine = pending["tail"].new()
                    if mine:
                        rec = mine[0]
                        pending["fault_to_next_step_s"] = now - pending["killed_at"]
                        pending["resumed_from"] = rec["step"] - 1
                        pending["redone"] = max(0, pending["last_step"] - pending["resumed_from"])
                        failures.append({k: v for k, v in pending.items() if k not in ("file", "tail")})
                        pending = None
                        next_kill = now + period_s
                if arrivals and next_kill is None and pending is None:
                    next_kill = now + period_s
                if next_kill is not None and pending is None and now >= next_kill:
                    rank = rng.randrange(world)
                    pid = training_pid(agent.pid, rank, pid_dir)
                    if pid is not None:
                        file = run_dir / "metrics" / f"rank{rank}.jsonl"
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:  # it finished training meanwhile: the run is ending
                            next_kill = now + period_s
                            continue
                        tail = Tail(file)
                        before = tail.new()  # read after: every line from here on is a new process's
                        pending = {"rank": rank, "killed_at": time.monotonic(), "file": file, "tail": tail,
                                   "lines": len(before),
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
        said = output.read_text(errors="replace")
        refusal = [line for line in said.splitlines() if line.startswith("[slipstream] healing in place is off")]
        return {
            "world": world, "layout": layout, "mode": mode, "snapshots": snapshots,
            "heals": said.count("replacing it in place"), "heal_refused": refusal[0] if refusal else None, "period_s": period_s, "steps": steps, "every": every,
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


def run_torchft(world: int, steps: int, period_s: float, seed: int) -> dict:
    """One torchft row (benchmarks/torchft_goodput.py in its own process: torchft's imports stay there)."""
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.json"
        subprocess.run([sys.executable, "-m", "benchmarks.torchft_goodput", "--replicas", str(world), "--period-s",
                        str(period_s), "--steps", str(steps), "--seed", str(seed), "--json", str(rows)],
                       cwd=REPO, check=False)
        if not rows.exists():
            return {"world": world, "layout": "ddp", "mode": "torchft", "period_s": period_s, "steps": steps,
                    "exit_code": 1, "failures": 0, "goodput": float("nan"), "redone_per_failure": float("nan"),
                    "fault_to_next_step_median_s": float("nan"), "fault_to_next_step_max_s": float("nan"),
                    "checkpoint_phase_median_ms": float("nan"), "median_step_s": float("nan"), "heals": 0}
        (row,) = json.loads(rows.read_text())
        return {**row, "layout": "ddp", "mode": "torchft", "heals": row.get("failures", 0)}


RECOVERS_FROM = {
    "disk": "disk (every {every} steps), all restart",
    "snapshots": "in-memory snapshot (every step), all restart",
    "heal": "in-memory snapshot, healed in place (warm spare)",
    "torchft": "torchft 0.2.0: a live peer, quorum per step",
}


def targets(rows: list[dict]) -> list[str]:
    """Issue #43's targets, checked on each heal row."""
    out = []
    for r in rows:
        if r["mode"] != "heal":
            continue
        peer = [t for t in rows if t["mode"] == "torchft" and t["world"] == r["world"] and t["layout"] == r["layout"]]
        checks = [("goodput >= 0.95", r["goodput"] >= 0.95),
                  ("fault to next step median <= 0.6 s", r["fault_to_next_step_median_s"] <= 0.6),
                  ("max <= 2 s", r["fault_to_next_step_max_s"] <= 2.0)]
        if peer:
            checks.append((f"above torchft's {peer[0]['goodput']:.2f}", r["goodput"] > peer[0]["goodput"]))
        said = "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks)
        healed = f"{r['heals']} of {r['failures']} deaths healed in place"
        if r.get("heal_refused"):
            healed += f" ({r['heal_refused']})"
        out.append(f"- {r['world']} ranks, {r['layout']}: {said}; {healed}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    p.add_argument("--layouts", default="ddp", help=f"comma-separated, of {', '.join(LAYOUTS)} (default ddp)")
    p.add_argument("--kill-every-s", "--period-s", dest="period_s", default="30",
                   help="comma-separated kill periods in seconds (default 30)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--every", type=int, default=50, help="disk checkpoint interval in steps (default 50)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="heal,disk,torchft",
                   help=f"comma-separated, of {', '.join(MODES)} (default heal,disk,torchft)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    # A SIGTERM (timeout, CI) unwinds through run_once's finally, which kills the run's process group
    # (without this a timed-out benchmark left its `slipstream run` training on).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES):
        p.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    layouts = [x for x in args.layouts.split(",") if x]
    if not layouts or set(layouts) - set(LAYOUTS):
        p.error(f"--layouts takes {', '.join(LAYOUTS)}, got {args.layouts!r}")
    if "torchft" in modes and importlib.util.find_spec("torchft") is None:
        print("torchft is not installed (pip install torchft==0.2.0, or scripts/install.sh bench): its rows are "
              "left out", flush=True)
        modes.remove("torchft")
    heal_default = healing_is_default()
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        for layout in layouts:
            for period in [float(t) for t in args.period_s.split(",")]:
                for mode in modes:
                    if mode == "torchft":
                        if layout != "ddp":
                            continue  # torchft's replicas are data parallel: one row per size, with ddp
                        row = run_torchft(world, args.steps, period, args.seed)
                    else:
                        row = run_once(world, args.steps, args.every, period, mode, args.seed, layout, heal_default)
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k not in ("failure_list", "replica_crashes")}),
                          flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}\n")
    print("| ranks | layout | kill every | recovers from | exit | failures | healed in place | goodput | "
          "steps redone per failure | fault to next step (median / max) | checkpoint phase per step (median) | "
          "step (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        source = RECOVERS_FROM[r["mode"]].format(every=r.get("every", args.every))
        print(f"| {r['world']} | {r['layout']} | {r['period_s']:.0f} s | {source} | {r['exit_code']} | {r['failures']} | "
              f"{r['heals']} | {r['goodput']:.2f} | {r['redone_per_failure']:.1f} | "
              f"{r['fault_to_next_step_median_s']:.2f} / {r['fault_to_next_step_max_s']:.2f} s | "
              f"{r['checkpoint_phase_median_ms']:.1f} ms | {r['median_step_s'] * 1000:.0f} ms |")
    print("\nissue #43's targets (heal rows):")
    print("\n".join(targets(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
