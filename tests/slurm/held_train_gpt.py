"""examples/train_gpt.py, held after one optimizer step until this process receives SIGTERM.

``python held_train_gpt.py HOLD_DIR HOLD_STEP [train_gpt.py's arguments]``

The preemption test needs SIGTERM to land while training runs. Sending it once a step line shows in
the job's output was a race: the tiny GPT trains its 60 steps in about 1.5 s, and the line reaches
the file through the worker, the agent's tee and srun, so on a loaded machine the job had finished
before the signal came (the requeued job then resumed at step 60). Here every rank, on its first
attempt (no HOLD_DIR/held-rankR yet), stops after optimizer step HOLD_STEP, writes
HOLD_DIR/held-rankR and waits until a SIGTERM reaches it, whichever handler the program has
installed for it by then (the checkpoint manager's sets a flag and the save happens at the next step
boundary). The requeued attempt finds the file and never holds. The math is train_gpt.py's own, so
the final weights must equal the uninterrupted run's.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

HOLD_LIMIT_S = 120.0
TRAIN_GPT = Path(__file__).resolve().parents[2] / "examples" / "train_gpt.py"

hold_dir, hold_step = Path(sys.argv[1]), int(sys.argv[2])
marker = hold_dir / f"held-rank{os.environ.get('RANK', '0')}"
holding = not marker.exists()
terminated = False
steps = 0
installed_signal = signal.signal


def note_sigterm(handler):
    """``handler``, first noting that SIGTERM came."""
    def noted(signum, frame):
        global terminated
        terminated = True
        if callable(handler):
            handler(signum, frame)
        elif handler == signal.SIG_DFL:  # what the default would have done, minus the core of a signal death
            raise SystemExit(128 + signum)
    return noted


def watching_signal(signum, handler):
    """signal.signal, with every SIGTERM handler the program installs wrapped by note_sigterm."""
    if signum == signal.SIGTERM:
        return installed_signal(signum, note_sigterm(handler))
    return installed_signal(signum, handler)


def hold(optimizer, args, kwargs) -> None:
    global steps, holding
    steps += 1
    if not holding or steps != hold_step:
        return
    holding = False
    marker.write_text(str(os.getpid()))
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not terminated:
        if time.monotonic() > deadline:
            raise SystemExit(f"held_train_gpt: no SIGTERM within {HOLD_LIMIT_S:.0f} s of step {hold_step}")
        time.sleep(0.05)


if holding:
    signal.signal = watching_signal
    register_optimizer_step_post_hook(hold)
sys.argv = [str(TRAIN_GPT), *sys.argv[3:]]
runpy.run_path(str(TRAIN_GPT), run_name="__main__")
