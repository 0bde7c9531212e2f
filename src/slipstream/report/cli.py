"""``slipstream report RUN_DIR [--out FILE.html] [--png-dir DIR]``."""

from __future__ import annotations

import argparse

from ..errors import UsageError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="write a self-contained HTML report (and PNGs) of a run directory",
        description="Read RUN_DIR/metrics/rank<R>.jsonl (and timeline/, hang.json if present) and write one "
        "self-contained HTML page with plots of loss, throughput, step-time breakdown, per-rank comparison and "
        "communication volume, a summary table, and PNG copies of the plots. Also merges the per-rank "
        "timelines into RUN_DIR/timeline.json (open it in ui.perfetto.dev).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (TrainConfig.run_dir)")
    p.add_argument("--out", metavar="FILE.html", help="where to write the page (default RUN_DIR/report.html)")
    p.add_argument("--png-dir", metavar="DIR", help="where to write the PNGs (default: report/ next to the page)")
    p.set_defaults(func=main)


def check_report_args(args: argparse.Namespace) -> None:
    """RUN_DIR, --out and --png-dir, and matplotlib, before any file is read: flag, rule, value."""
    import importlib.util
    import os

    if not os.path.isdir(args.run_dir):
        what = "a file" if os.path.exists(args.run_dir) else "no such directory"
        raise UsageError(f"RUN_DIR must be a run directory, got {what}: {args.run_dir}")
    if args.out is not None and (os.path.isdir(args.out) or not _creatable(args.out)):
        raise UsageError(f"--out must be a file path (its folders are made), got {args.out!r}")
    if args.png_dir is not None and os.path.exists(args.png_dir) and not os.path.isdir(args.png_dir):
        raise UsageError(f"--png-dir must be a directory, got a file: {args.png_dir}")
    if importlib.util.find_spec("matplotlib") is None:
        from ..extras import pip_install_hint

        raise UsageError(f"report draws its plots with matplotlib, which the plain install leaves out: "
                         f"{pip_install_hint('metrics')}")


def main(args: argparse.Namespace) -> int:
    check_report_args(args)
    from .html import write_report

    out, pngs = write_report(args.run_dir, out=args.out, png_dir=args.png_dir)
    print(f"report: {out}")
    if pngs:
        print(f"figures: {', '.join(pngs)}")
    return 0


def _creatable(path: str) -> bool:
    """Whether ``path``'s folders exist or can be made: its nearest existing ancestor is a directory."""
    import os

    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return os.path.isdir(parent)
