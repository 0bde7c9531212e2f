"""Errors and process exit codes shared by the library and the CLI.

Exit codes (documented in README.md, matched by Kubernetes podFailurePolicy):

* 0   success
* 1   training failed (a worker failed and the restart budget is spent)
* 2   usage or configuration error (bad flag, missing file, invalid spec); also
      when raised in a worker: ``slipstream run`` exits 2 with the worker's
      message and does not restart it (it would recur)
* 130 interrupted by the user (Ctrl-C)
* 143 preempted: SIGTERM arrived, an emergency checkpoint was written, the job
      can be resumed (128 + SIGTERM; a podFailurePolicy can match it)
"""

from __future__ import annotations

import difflib

EXIT_OK = 0
EXIT_TRAINING_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_PREEMPTED = 143


class SlipstreamError(Exception):
    """Base class for errors Slipstream reports to the user without a traceback."""

    exit_code = EXIT_USAGE


class ConfigError(SlipstreamError, ValueError):
    """A configuration value is invalid; the message names the field, rule and value."""


class UsageError(SlipstreamError):
    """The command line or environment is unusable (missing script, busy port, ...)."""


class TrainingFailed(SlipstreamError):
    """Workers failed and no restarts remain."""

    exit_code = EXIT_TRAINING_FAILED


def did_you_mean(word: str, candidates: list[str] | tuple[str, ...], quote: bool = False) -> str:
    """`` (did you mean X?)`` for the candidate closest to ``word``, or ``""`` when none is close.

    Example::

        did_you_mean("--nproc-per-nod", ["--nproc-per-node", "--nnodes"])   # " (did you mean --nproc-per-node?)"
    """
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean {close[0]!r}?)" if quote else f" (did you mean {close[0]}?)"
