"""``slipstream env [--json]``: versions, devices, interfaces, extras and the configuration
from the environment, for a bug report (the facts: :mod:`slipstream.env_report`)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "env", help="print versions, devices, network interfaces, extras and the environment's configuration",
        description="Print what a bug report needs: the versions of Slipstream, Python, torch, CUDA and NCCL; "
        "the GPUs; the network interfaces and their addresses; the extras installed; and the configuration "
        "the environment gives a run (SLIPSTREAM_* variables, and the torch, NCCL and gloo ones). Paste it "
        "into the issue. Values of variables whose names look secret (KEY, TOKEN, ...) are not shown.",
    )
    p.add_argument("--json", action="store_true", help="print it as one JSON object")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import json

    from . import collect_env, render_env

    report = collect_env()
    print(json.dumps(report.as_dict(), indent=1) if args.json else render_env(report))
    return 0
