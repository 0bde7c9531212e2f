"""What one killed training process costs a user who gave no flag (issue #43's first done-when).

The GPT example under ``slipstream run -n W`` with no recovery flag at all (healing in place
is the default), in pairs run one after the other on one machine:

* the reference: uninterrupted, ``--steps N``;
* the killed run: the same, and once rank ``--kill-rank`` has logged step ``--kill-step`` its
  training process gets SIGKILL (the pid its supervisor writes to ``SLIPSTREAM_HEAL_PID_DIR``).

Per pair: the cost (the killed run's wall time minus the reference's), whether the killed run
healed in place (the supervisor's "replacing it in place" line, and no "restarts every worker"
or full restart), and whether its final weights are bitwise equal to the reference's (the
example's ``--out``: the whole model's state_dict). Reported per layout: every pair's cost and
the median, against the issue's target of at most 1 s.

    python -m benchmarks.heal_cost                        # ddp and dp_shard, 3 pairs each, 2 ranks
    python -m benchmarks.heal_cost --layouts ddp --pairs 1 --steps 60 --kill-step 30   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.goodput import records  # noqa: E402 - a metrics file's complete lines (run as a script or a module)
GPT = str(REPO / "examples" / "train_gpt.py")
TARGET_S = 1.0


def _run(tmp: Path, name: str, world: int, layout: str, steps: int, kill: tuple[int, int] | None,
         timeout_s: float) -> dict:
    out, run_dir, pids = tmp / f"{name}-out", tmp / f"{name}-run", tmp / f"{name}-pids"
    pids.mkdir()
    cmd = [sys.executable, "-m", "slipstream", "run", "-n", str(world), "--run-dir", str(run_dir),
           "--log-every-steps", "1", GPT, "--steps", str(steps), "--out", str(out),
           *(["--dp-shard", str(world)] if layout == "dp_shard" else [])]
    env = {**os.environ, "SLIPSTREAM_HEAL_PID_DIR": str(pids)}
    log_path = tmp / f"{name}.log"
    started = time.monotonic()
    killed_at = None
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while proc.poll() is None:
                if kill is not None and killed_at is None:
                    rank, step = kill
                    seen = records(run_dir / "metrics" / f"rank{rank}.jsonl")
                    pid_file = pids / f"rank{rank}.pid"
                    if seen and seen[-1].get("step", -1) >= step and pid_file.exists():
                        os.kill(int(pid_file.read_text()), signal.SIGKILL)
                        killed_at = time.monotonic() - started
                if time.monotonic() - started > timeout_s:
                    raise TimeoutError(f"{name} ran past {timeout_s:.0f} s")
                time.sleep(0.01)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.monotonic() - started
    said = log_path.read_text(errors="replace")
    return {"wall_s": wall, "code": proc.returncode, "killed_at_s": killed_at, "out": out, "said": said,
            "healed": said.count("replacing it in place"), "restarted": "restarts every worker" in said
            or "attempt 1" in said.lower()}


def _bitwise(a: Path, b: Path) -> bool:
    import torch

    files = sorted(p.name for p in a.iterdir() if p.suffix in (".pt", ".pth"))
    if not files:
        return False
    for name in files:
        x, y = torch.load(a / name, weights_only=True), torch.load(b / name, weights_only=True)
        x = x.get("model", x) if isinstance(x, dict) else x
        y = y.get("model", y) if isinstance(y, dict) else y
        if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default="ddp,dp_shard")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-step", type=int, default=100)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write the rows here too")
    args = p.parse_args(argv)
    rows = []
    for layout in args.layouts.split(","):
        for pair in range(args.pairs):
            with tempfile.TemporaryDirectory() as tmp_name:
                tmp = Path(tmp_name)
                ref = _run(tmp, "ref", args.world, layout, args.steps, None, args.timeout_s)
                hit = _run(tmp, "killed", args.world, layout, args.steps, (args.kill_rank, args.kill_step),
                           args.timeout_s)
                same = ref["code"] == 0 and hit["code"] == 0 and _bitwise(ref["out"], hit["out"])
                row = {"layout": layout, "pair": pair, "ref_wall_s": round(ref["wall_s"], 2),
                       "killed_wall_s": round(hit["wall_s"], 2), "cost_s": round(hit["wall_s"] - ref["wall_s"], 2),
                       "killed_at_s": hit["killed_at_s"], "healed_in_place": hit["healed"],
                       "full_restart": hit["restarted"], "bitwise": same, "codes": (ref["code"], hit["code"])}
                if hit["healed"] != 1 or hit["restarted"] or not same:
                    row["killed_log_tail"] = hit["said"][-1500:]
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "killed_log_tail"}), flush=True)
                for line in hit["said"].splitlines():  # what the heal said: the replacement, the heal's time, the cadence
                    if "[slipstream]" in line and ("heal" in line or "snapshots every" in line or "replac" in line):
                        print("   ", line.strip()[-260:], flush=True)
    print()
    print("| layout | pairs | cost per pair (s) | median cost (s) | healed in place | bitwise |")
    print("|---|---|---|---|---|---|")
    ok = True
    for layout in args.layouts.split(","):
        mine = [r for r in rows if r["layout"] == layout]
        median = statistics.median(r["cost_s"] for r in mine)
        healed = sum(r["healed_in_place"] == 1 and not r["full_restart"] for r in mine)
        same = sum(r["bitwise"] for r in mine)
        ok &= median <= TARGET_S and healed == len(mine) == same
        costs = ", ".join(f"{r['cost_s']:+.2f}" for r in mine)
        print(f"| {layout} | {len(mine)} | {costs} | {median:+.2f} "
              f"| {healed}/{len(mine)} | {same}/{len(mine)} |")
    print(f"\ntarget: median cost at most {TARGET_S:.0f} s, every kill healed in place and bitwise: "
          f"{'met' if ok else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
