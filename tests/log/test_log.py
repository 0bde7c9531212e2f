"""slipstream/log.py: what print() said stays the same text on stderr; nothing else is added."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import logging
from slipstream.log import CONSOLE
logging.getLogger("slipstream.job.runner").info("slipstream run: replica %d is up", 1, extra=CONSOLE)
logging.getLogger("slipstream.sync").info("quiet unless configured")
logging.getLogger("slipstream.checkpoint").warning("a warning, as before")
"""


def test_console_records_and_warnings_go_to_stderr_as_bare_text():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr == "slipstream run: replica 1 is up\na warning, as before\n"


def test_an_application_logging_config_takes_over():
    proc = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(format='APP %(message)s')\n"
                           + SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert "APP slipstream run: replica 1 is up" in lines and "APP a warning, as before" in lines
    assert "slipstream run: replica 1 is up" not in lines  # said once, by the application's handler


def test_a_root_handler_that_writes_elsewhere_leaves_the_console_lines_alone(tmp_path):
    """A file handler (or pytest's capturing handler) shows the user nothing: the lines still reach stderr."""
    log_file = tmp_path / "app.log"
    proc = subprocess.run([sys.executable, "-c", f"import logging; logging.basicConfig(filename={str(log_file)!r})\n"
                           + SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "slipstream run: replica 1 is up\na warning, as before\n"
    assert "a warning, as before" in log_file.read_text()


def test_console_lines_reach_stderr_under_pytest_logging_capture(capsys):
    import logging

    from slipstream.log import CONSOLE

    assert logging.getLogger().handlers  # pytest's capturing handler is on the root logger here
    logging.getLogger("slipstream.launch.api").info("slipstream run: training failed (a test)", extra=CONSOLE)
    assert capsys.readouterr().err == "slipstream run: training failed (a test)\n"
