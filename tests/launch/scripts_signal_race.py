"""Count how often a raising signal handler leaves a Popen's wait lock held.

Usage: python scripts_signal_race.py (torch|safe) TRIES

Each try starts a child, polls it in a tight loop and has SIGPROF arrive a few
milliseconds of CPU time later (ITIMER_PROF: SIGALRM is the safe handler's own),
with torch's agent handler or slipstream.process.safe_signals' handler raising out of
the loop. Prints one JSON line: {"orphaned": N, "tries": T, "seconds": S,
"slowest_try_s": W}; "orphaned" counts the tries after which the Popen's lock
was still held (every later poll() would say "running").
"""

import json
import os
import signal
import subprocess
import sys
import time

from torch.distributed.elastic.multiprocessing import api as mp_api

from slipstream.process import safe_signals

kind, tries = sys.argv[1], int(sys.argv[2])
if kind == "torch":
    handler = mp_api._terminate_process_handler
    caught = mp_api.SignalException
else:
    handler = safe_signals.handler(lambda signum: mp_api.SignalException("stop", sigval=signal.Signals(signum)))
    caught = mp_api.SignalException
signal.signal(signal.SIGPROF, handler)


def between_polls() -> None:
    """Code of our own between two polls, as the agent sleeps in its own loop between them: where
    the safe handler raises (a redelivered signal lands here about half the time)."""
    for _ in range(50):
        pass


orphaned = 0
started = time.monotonic()
slowest = 0.0
for i in range(tries):
    began = time.monotonic()
    child = subprocess.Popen(["sleep", "30"])
    try:
        signal.setitimer(signal.ITIMER_PROF, 0.002 + (i % 37) * 0.00013)
        while True:
            child.poll()
            between_polls()
    except caught:
        pass
    slowest = max(slowest, time.monotonic() - began)
    if child._waitpid_lock.locked():
        orphaned += 1
    child.kill()
    if child._waitpid_lock.locked():
        os.waitpid(child.pid, 0)  # Popen.wait() would time out: its lock is the one orphaned
    else:
        child.wait()
print(json.dumps({"orphaned": orphaned, "tries": tries, "seconds": round(time.monotonic() - started, 2),
                  "slowest_try_s": round(slowest, 3)}))
