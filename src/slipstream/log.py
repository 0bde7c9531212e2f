"""Slipstream's console: library modules log, and this one handler says it on stderr.

Library modules log through :mod:`logging` under the ``slipstream`` logger
(``log = logging.getLogger(__name__)``). What a module used to ``print()`` for
the user to read is logged with ``extra=CONSOLE``; importing this module puts one
handler on the ``slipstream`` logger that writes those records, and every
warning or error, as bare text on ``sys.stderr`` -- the same text on the same
stream as before, and what Python's last-resort handler shows for a library
without one. Other records (``log.info`` without ``CONSOLE``, ``log.debug``) stay
quiet unless you configure logging.

How much is said: ``slipstream run --log-level {debug,info,warning,error}`` (``-q``: warning)
sets the ``slipstream`` logger's level in the launcher and, through ``SLIPSTREAM_LOG_LEVEL``, in
every worker (read here, at import). ``info`` is the default (the console records and every
warning); ``debug`` adds every record the library logs; ``warning`` keeps only warnings and
errors; ``error`` only errors.

If the application shows logging on the console itself (a root handler writing
to stderr or stdout, e.g. ``logging.basicConfig``), this handler steps aside and
the application's handlers and levels decide, so nothing is said twice. A root
handler that writes elsewhere (a file, a test runner's buffer) does not count:
the console lines still appear.

Example::

    import logging
    from slipstream.log import CONSOLE

    log = logging.getLogger(__name__)
    log.info("slipstream run: replica %d exited with code %d", 1, 3, extra=CONSOLE)  # on stderr, as print() was
    log.info("probed link: %s", summary)                                            # only when configured
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

CONSOLE = {"slipstream_console": True}
"""``extra=`` of a record the user reads on the console by default (what ``print()`` said)."""

LOG_LEVELS = ("debug", "info", "warning", "error")
"""The values of ``--log-level`` and of :data:`ENV_LOG_LEVEL`."""
ENV_LOG_LEVEL = "SLIPSTREAM_LOG_LEVEL"
"""The launcher's ``--log-level`` for its workers (``slipstream run`` sets it; a user may too)."""


class _ConsoleHandler(logging.Handler):
    """Bare messages on the current ``sys.stderr`` (looked up per record, so redirections and
    pytest's capture see them), for console records and warnings, while the application has
    no logging configuration of its own."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.setFormatter(logging.Formatter("%(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        if _application_shows_console():  # the application's own handler puts records on the console
            return False
        if logging.getLogger("slipstream").level == logging.DEBUG:  # --log-level debug: every record
            return True
        return record.levelno >= logging.WARNING or bool(getattr(record, "slipstream_console", False))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def _application_shows_console() -> bool:
    """True when a root handler already writes to the console (``logging.basicConfig()``, say).

    Only such a handler makes ours step aside: one that writes to a file, or a test
    runner's capturing handler (pytest's writes to a buffer), shows the user nothing,
    so the console lines must still come from here.
    """
    consoles = {id(s) for s in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__) if s is not None}
    return any(
        isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) and id(h.stream) in consoles
        for h in logging.getLogger().handlers
    )


def install_console() -> logging.Logger:
    """Put the console handler on the ``slipstream`` logger (once) and return that logger.

    Called when this module is imported; idempotent.

    Example::

        install_console().info("hello", extra=CONSOLE)   # "hello" on stderr
    """
    logger = logging.getLogger("slipstream")
    if not any(isinstance(h, _ConsoleHandler) for h in logger.handlers):
        logger.addHandler(_ConsoleHandler())
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)  # console records are INFO; the handler filters the rest
            wanted = env_level()
            if wanted is not None:
                set_level(wanted)
    return logger


def env_level(environ: Mapping[str, str] | None = None) -> str | None:
    """The level :data:`ENV_LOG_LEVEL` asks for (None: not set). A value that is not one of
    :data:`LOG_LEVELS` is said once, as a warning, and ignored: a typo in a variable must not
    stop every worker at import.

    Example::

        env_level({"SLIPSTREAM_LOG_LEVEL": "WARNING"})   # "warning"
    """
    wanted = (os.environ if environ is None else environ).get(ENV_LOG_LEVEL, "").strip().lower()
    if wanted in LOG_LEVELS:
        return wanted
    if wanted:
        logging.getLogger("slipstream").warning(
            f"slipstream: {ENV_LOG_LEVEL}={wanted!r} is not one of {', '.join(LOG_LEVELS)}; using info")
    return None


def set_level(name: str) -> None:
    """Set how much the ``slipstream`` logger says in this process: one of :data:`LOG_LEVELS`.

    Example::

        set_level("warning")   # console lines (INFO) gone; warnings and errors still shown
    """
    if name not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {name!r}")
    logging.getLogger("slipstream").setLevel(getattr(logging, name.upper()))


install_console()

__all__ = ["CONSOLE", "ENV_LOG_LEVEL", "LOG_LEVELS", "env_level", "install_console", "set_level"]
