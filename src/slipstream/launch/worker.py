"""The worker process of ``slipstream run``: the training script, plus a safe exit.

``slipstream run`` starts each worker as ``python -u -m slipstream.launch.worker
SCRIPT ARGS...`` (or ``--module MODULE ARGS...``) instead of ``python -u
SCRIPT ARGS...``. It runs the script exactly as Python would, as ``__main__``,
with the same ``sys.argv``, ``sys.path[0]`` and ``__file__``, so unmodified
torchrun scripts behave the same. The one addition: at exit it waits for
torch's gloo worker threads to settle (:mod:`slipstream.process.gloo_exit`), which keeps
torch 2.13 from aborting a rank that finished training (SIGABRT in interpreter
teardown), an abort the elastic agent would otherwise count as a failed
attempt and restart the job for. ``python -m`` cannot take a hook of its own,
so this small entry point is the way to add one without touching the script.
When ``slipstream run`` was given training options (``--sync``, ...), every
DistributedDataParallel model the script builds gets them first
(:mod:`slipstream.train.adopt`: zero-change acceleration).
A :class:`~slipstream.errors.SlipstreamError` escaping the script ends the
worker as ``slipstream.init()``'s excepthook would: one line, its exit code.
Started by ``slipstream run`` (``SLIPSTREAM_AGENT_PID`` set), the worker first
arms itself to die with its launcher (:mod:`slipstream.launch.parent_death`),
so a launcher killed with SIGKILL leaves no workers training on behind it.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
from typing import NoReturn

from slipstream.errors import SlipstreamError, UsageError
from slipstream.launch.parent_death import die_with_agent
from slipstream.process import gloo_exit
from slipstream.resilience import heal_env

USAGE = "usage: python -m slipstream.launch.worker (SCRIPT | --module MODULE) [ARGS...]"


def run_as_main(argv: list[str]) -> dict:
    """Run ``SCRIPT ARGS`` or ``-m``/``--module MODULE ARGS`` as ``__main__``, as
    ``python`` would; returns the script's globals (its objects live while they do)."""
    if argv[0] in ("-m", "--module"):
        module, args = argv[1], argv[2:]
        _require_module(module)
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0], as python -m does
        return runpy.run_module(module, run_name="__main__", alter_sys=True)
    script, args = argv[0], argv[1:]
    sys.argv = [script, *args]
    # `python SCRIPT` puts the script's folder first on sys.path; `-m` put the cwd there.
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    return runpy.run_path(script, run_name="__main__")


def _require_module(name: str) -> None:
    """A module ``python -m`` could not find is a usage error (one line, exit 2, no restart),
    not an ImportError traceback; an ImportError raised while the module runs stays one."""
    import importlib.util

    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing, or name is not a module name
        found = False
    if not found:
        raise UsageError(f"-m/--module: no module named {name!r}")


# What a collective raises in a rank whose peer process ended (gloo's pair.cc, NCCL's abort).
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote process exited or there was a network error")


PEER_GONE_GRACE_S = 3.0
"""How long a rank whose peer left waits (for its agent to stop it) before it exits 1."""


def peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank's process ended
    (a consequence: that rank's own error is the one to read)."""
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _PEER_GONE)


def exit_peer_gone(exc: BaseException) -> NoReturn:
    """End this rank with one line, not the 30-line traceback of a collective whose peer left.

    The rank that left first reported its own error (a configuration error: exit 2, which
    the launcher reports once); this one says where it was (the script's line) and exits 1.
    The line also goes to the error file, so the launcher's report shows it as the reason.
    ``os._exit``: see :func:`slipstream.process.runtime.exit_on_error`.
    """
    import json
    import time
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not _library_frame(f.filename)]
    where = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = next((text for text in _PEER_GONE if text in first), first)
    line = (f"slipstream: rank {os.environ.get('RANK', '?')} stopped{where}: a collective lost its peer "
            f"({reason}); another rank ended first, its error says why")
    sys.stdout.flush()
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w", encoding="utf-8") as fh:
                json.dump({"message": line, "timestamp": int(time.time())}, fh)
        except OSError:
            pass
    # The rank that failed is the cause: give the agent time to see its exit first, so the
    # launcher's summary names it as the first failure (this one exits at once otherwise,
    # ahead of a rank still printing its traceback). The agent then stops this rank.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(PEER_GONE_GRACE_S)
    os._exit(1)


def _library_frame(filename: str) -> bool:
    """A frame of torch, the standard library's runpy or this entry, not of the user's script."""
    return (f"{os.sep}torch{os.sep}" in filename or filename.startswith("<frozen")
            or filename == os.path.abspath(__file__))


def adopt_ddp_models():  # -> slipstream.train.adopt.Adopter | None
    """Zero-change acceleration (:mod:`slipstream.train.adopt`): when ``slipstream run`` was given a
    training option, every DDP model the script builds gets it. Without one, nothing is imported
    or changed: the script runs as under torchrun."""
    from slipstream.config import options_in_env
    from slipstream.launch import process_group_flags

    if process_group_flags.given(os.environ):
        process_group_flags.install(os.environ)
    if not options_in_env(os.environ):
        return None
    from slipstream.train import adopt  # imports torch: only now

    return adopt.install(os.environ)


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-m", "--module") and len(argv) < 2:
        sys.exit(f"slipstream worker: {USAGE}")
    # Before anything slow (torch's import takes seconds): a launcher that dies
    # from here on takes this worker with it, one that died already ends it now.
    die_with_agent()
    # Imports torch: after the check, and before install() as it always was,
    # so torch's own exit handlers still run after the gloo wait (LIFO).
    from slipstream.process.runtime import exit_on_error

    gloo_exit.install()
    adopter = None
    try:
        adopter = adopt_ddp_models()
        script_globals = run_as_main(argv)
    except SlipstreamError as exc:
        # Also before (or without) slipstream.init(), whose excepthook does the
        # same: one line, the message in the error file, exit 2 for a
        # configuration error, which the launcher does not restart.
        exit_on_error(exc)
    except SystemExit:  # the script's own sys.exit(): its last metrics window still counts
        if adopter is not None:
            adopter.finish()
        raise
    except Exception as exc:
        diagnosed = adopter.diagnose(exc) if adopter is not None else None
        if diagnosed is not None:  # a collective of the script's own loop hung or lost a peer
            exit_on_error(diagnosed)
        if not peer_gone(exc):
            raise
        exit_peer_gone(exc)
    if adopter is not None:
        adopter.finish()
    # The script's objects (a DDP model holding the process group, ...) are
    # freed when its globals go; settle the worker threads before that.
    gloo_exit.wait_for_gloo_workers()
    del script_globals


def entry(argv: list[str]) -> None:
    """``python -m slipstream.launch.worker``: the worker itself, or under ``slipstream run --heal``
    the rank's supervisor over it (:mod:`slipstream.launch.supervisor`)."""
    if os.environ.get(heal_env.HEAL) == "1" and os.environ.get(heal_env.CHILD) != "1":
        from slipstream.launch.supervisor import exit_like, supervise

        exit_like(supervise(argv))
    main(argv)


if __name__ == "__main__":
    entry(sys.argv[1:])
