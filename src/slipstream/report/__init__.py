"""``slipstream report RUN_DIR``: one self-contained HTML page (and PNGs) from a run directory.

Example::

    from slipstream.report import write_report
    html_path, pngs = write_report("runs/x")
"""

from .data import Run, load_run
from .html import render_html, write_report

__all__ = ["Run", "load_run", "render_html", "write_report"]
