"""``slipstream report RUN_DIR [--out FILE.html] [--png-dir DIR]``."""

from __future__ import annotations

import argparse


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


def main(args: argparse.Namespace) -> int:
    from .html import write_report

    out, pngs = write_report(args.run_dir, out=args.out, png_dir=args.png_dir)
    print(f"report: {out}")
    if pngs:
        print(f"figures: {', '.join(pngs)}")
    return 0
