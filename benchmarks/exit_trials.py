"""How often does a finished 2-process gloo job die at exit? slipstream run vs torchrun.

Each trial runs tests/integration/scripts_ddp_plain.py (20 DDP steps, then
barrier and destroy_process_group) under each launcher in turn, while
``--load`` busy loops compete for the cores, which widens torch 2.13's race
at interpreter teardown (see src/slipstream/process/gloo_exit.py). A trial fails
when the launcher exits non-zero; the reason is the worker's last words.

    python benchmarks/exit_trials.py --trials 60 --load 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "integration" / "scripts_ddp_plain.py"
ABORT = "terminate called without an active exception"

LAUNCHERS = {
    "slipstream run": [sys.executable, "-m", "slipstream", "run", "-n", "2"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
}


def trial(cmd: list[str], timeout_s: float = 180) -> str:
    """'' on success, else why it failed."""
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([*cmd, str(SCRIPT), "--out", out], capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode == 0:
            return ""
        return "SIGABRT at exit: " + ABORT if ABORT in proc.stderr else proc.stderr.strip()[-200:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=60)
    p.add_argument("--load", type=int, default=3, help="busy loops beside the job (default 3)")
    args = p.parse_args()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    failures: dict[str, list[str]] = {name: [] for name in LAUNCHERS}
    try:
        for i in range(args.trials):
            for name, cmd in LAUNCHERS.items():  # in turns, so both see the same load
                why = trial(cmd)
                if why:
                    failures[name].append(why)
                    print(f"trial {i + 1}: {name} failed: {why}", file=sys.stderr, flush=True)
    finally:
        for h in hogs:
            h.kill()
    print(f"| launcher | finished jobs that exited 0 ({args.load} busy loops beside) |")
    print("|---|---|")
    for name, why in failures.items():
        aborts = sum(w.startswith("SIGABRT") for w in why)
        print(f"| {name} | {args.trials - len(why)}/{args.trials} ({aborts} SIGABRT at exit) |")


if __name__ == "__main__":
    main()
