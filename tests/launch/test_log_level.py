"""--log-level and -q: one level, checked before anything starts, for the launcher and its workers
(issue #46: there was no quiet or log-level switch)."""

from __future__ import annotations

import logging

import pytest

from slipstream.cli import build_parser
from slipstream.errors import UsageError
from slipstream.launch.cli import launch_options_from_args, log_level, run_flags
from slipstream.log import CONSOLE, env_level, set_level


def _level(*flags: str) -> str | None:
    return log_level(run_flags(build_parser().parse_args(["run", *flags, "train.py"])))


def test_the_flags_give_one_level():
    assert _level() is None
    assert _level("-q") == _level("--quiet") == "warning"
    assert _level("--log-level", "DEBUG") == "debug"
    assert _level("-q", "--log-level", "error") == "error"


@pytest.mark.parametrize("flags, words", [
    (("--log-level", "warn"), "--log-level must be one of debug, info, warning, error, got 'warn' (did you mean 'warning'?)"),
    (("-q", "--log-level", "debug"), "-q/--quiet means --log-level warning; it cannot go with --log-level debug"),
])
def test_a_bad_level_is_one_line(flags, words):
    with pytest.raises(UsageError) as err:
        _level(*flags)
    assert str(err.value) == words


def test_the_level_reaches_the_launch_options(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    args = build_parser().parse_args(["run", "-q", "--no-summary", str(script)])
    opts = launch_options_from_args(args)
    assert opts.log_level == "warning" and opts.summary is False
    # in the workers' environment too: a job spec's replicas (their own agents) get it from there
    assert opts.worker_env["SLIPSTREAM_LOG_LEVEL"] == "warning"


def test_the_workers_read_the_level_from_their_environment():
    assert env_level({"SLIPSTREAM_LOG_LEVEL": " Warning "}) == "warning"
    assert env_level({}) is None
    assert env_level({"SLIPSTREAM_LOG_LEVEL": "loud"}) is None  # said as a warning, then ignored


def test_each_level_shows_what_it_says(capsys):
    logger = logging.getLogger("slipstream")
    log = logging.getLogger("slipstream.test_log_level")
    saved = logger.level
    try:
        shown = {}
        for level in ("debug", "info", "warning", "error"):
            set_level(level)
            log.debug("d")
            log.info("i")
            log.info("c", extra=CONSOLE)
            log.warning("w")
            log.error("e")
            shown[level] = capsys.readouterr().err.split()
    finally:
        logger.setLevel(saved)
    assert shown == {"debug": ["d", "i", "c", "w", "e"], "info": ["c", "w", "e"], "warning": ["w", "e"], "error": ["e"]}
