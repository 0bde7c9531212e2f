"""The ``slipstream`` command: one sub-command per module.

Each module in ``_COMMAND_MODULES`` provides ``register(subparsers)``, which
adds its parser and sets ``func`` to a ``main(args) -> int`` that turns the
arguments into a typed request (``LaunchOptions``, ``JobRun``, ...) and calls down.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .errors import EXIT_INTERRUPTED, EXIT_USAGE, SlipstreamError

_COMMAND_MODULES = (
    "slipstream.launch.cli",
    "slipstream.data.cli",
    "slipstream.job.cli",
    "slipstream.report.cli",
    "slipstream.bench.cli",
    "slipstream.plan.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Distributed training engine on PyTorch: launch, synchronise, recover, deploy.",
    )
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(_command(args)(args) or 0)
    except SlipstreamError as exc:
        print(f"slipstream {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"slipstream {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _command(args: argparse.Namespace):  # noqa: ANN202 - a `main(args) -> int` of a sub-command
    """The sub-command's ``main``. ``slipstream run JOB.yaml`` is the job runner's and
    ``slipstream run SCRIPT`` the launcher's: the choice is made here, above both tools, so
    the launcher never imports the job package (job -> launch is the one direction)."""
    if args.command == "run":
        from .job.spec import is_job_file

        if is_job_file(args.script):
            from .job.cli import run_main

            return run_main
    return args.func


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
