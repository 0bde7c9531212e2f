"""How often does a restart after a killed worker succeed? slipstream run vs torchrun.

Each trial launches 2 gloo workers with --max-restarts 1; rank 1 SIGKILLs
itself on the first attempt after the gloo mesh has formed
(tests/integration/scripts_restart_worker.py). A trial succeeds when the
launcher exits 0 and both ranks report restart count 1.

    python benchmarks/restart_trials.py --trials 20
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from slipstream.launch.proc import kill_tree

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "integration" / "scripts_restart_worker.py"

LAUNCHERS = {
    "slipstream run": [sys.executable, "-m", "slipstream", "run", "-n", "2", "--max-restarts", "1"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"],
}


def trial(cmd: list[str], timeout_s: float = 120) -> tuple[bool, float, str]:
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        proc = subprocess.Popen([*cmd, str(WORKER), "--out", out, "--kill-rank", "1"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)  # the workers live in sessions of their own
            proc.communicate()
            return False, time.perf_counter() - started, f"hung: no exit within {timeout_s:.0f} s"
        elapsed = time.perf_counter() - started
        ok = proc.returncode == 0 and all(
            json.loads((Path(out) / f"rank{r}.json").read_text())["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
            for r in range(2)
        )
        lines = [line for line in stderr.splitlines() if "refused" in line or "Error" in line]
        reason = "" if ok else (lines or stderr.strip().splitlines() or ["?"])[0][-200:]
        return ok, elapsed, reason


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated subset of: " + ", ".join(LAUNCHERS))
    args = p.parse_args()
    print("| launcher | restarts that succeeded | median time per trial |")
    print("|---|---|---|")
    for name, cmd in LAUNCHERS.items():
        if name not in args.launchers.split(","):
            continue
        results = [trial(cmd) for _ in range(args.trials)]
        ok = sum(r[0] for r in results)
        hung = sum(r[2].startswith("hung") for r in results)
        times = sorted(r[1] for r in results)
        note = f" ({hung} hung)" if hung else ""
        print(f"| {name} | {ok}/{args.trials}{note} | {times[len(times) // 2]:.1f} s |", flush=True)
        for r in results:
            if not r[0]:
                print(f"  failure: {r[2]}", file=sys.stderr)


if __name__ == "__main__":
    main()
