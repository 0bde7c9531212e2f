"""The worker process of ``slipstream run``: the training script, plus a safe exit.

``slipstream run`` starts each worker as ``python -u -m slipstream.launch.worker
SCRIPT ARGS...`` (or ``--module MODULE ARGS...``) instead of ``python -u
SCRIPT ARGS...``. It runs the script exactly as Python would, as ``__main__``,
with the same ``sys.argv``, ``sys.path[0]`` and ``__file__``, so unmodified
torchrun scripts behave the same. The one addition: at exit it waits for
torch's gloo worker threads to settle (:mod:`slipstream.gloo_exit`), which keeps
torch 2.13 from aborting a rank that finished training (SIGABRT in interpreter
teardown), an abort the elastic agent would otherwise count as a failed
attempt and restart the job for. ``python -m`` cannot take a hook of its own,
so this small entry point is the way to add one without touching the script.
A :class:`~slipstream.errors.SlipstreamError` escaping the script ends the
worker as ``slipstream.init()``'s excepthook would: one line, its exit code.
Started by ``slipstream run`` (``SLIPSTREAM_AGENT_PID`` set), the worker first
arms itself to die with its launcher (:mod:`slipstream.launch.parent_death`),
so a launcher killed with SIGKILL leaves no workers training on behind it.
"""

from __future__ import annotations

import os
import runpy
import sys

from slipstream import gloo_exit
from slipstream.errors import SlipstreamError
from slipstream.launch.parent_death import die_with_agent

USAGE = "usage: python -m slipstream.launch.worker (SCRIPT | --module MODULE) [ARGS...]"


def run_as_main(argv: list[str]) -> dict:
    """Run ``SCRIPT ARGS`` or ``-m``/``--module MODULE ARGS`` as ``__main__``, as
    ``python`` would; returns the script's globals (its objects live while they do)."""
    if argv[0] in ("-m", "--module"):
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0], as python -m does
        return runpy.run_module(module, run_name="__main__", alter_sys=True)
    script, args = argv[0], argv[1:]
    sys.argv = [script, *args]
    # `python SCRIPT` puts the script's folder first on sys.path; `-m` put the cwd there.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    return runpy.run_path(script, run_name="__main__")


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-m", "--module") and len(argv) < 2:
        sys.exit(f"slipstream worker: {USAGE}")
    # Before anything slow (torch's import takes seconds): a launcher that dies
    # from here on takes this worker with it, one that died already ends it now.
    die_with_agent()
    # Imports torch: after the check, and before install() as it always was,
    # so torch's own exit handlers still run after the gloo wait (LIFO).
    from slipstream.runtime import exit_on_error

    gloo_exit.install()
    try:
        script_globals = run_as_main(argv)
    except SlipstreamError as exc:
        # Also before (or without) slipstream.init(), whose excepthook does the
        # same: one line, the message in the error file, exit 2 for a
        # configuration error, which the launcher does not restart.
        exit_on_error(exc)
    # The script's objects (a DDP model holding the process group, ...) are
    # freed when its globals go; settle the worker threads before that.
    gloo_exit.wait_for_gloo_workers()
    del script_globals


if __name__ == "__main__":
    main(sys.argv[1:])
