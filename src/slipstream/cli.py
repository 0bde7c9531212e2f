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

# Each command and the module whose ``register`` adds it, in the order ``--help`` lists them.
# Only the module of the command given is imported (``slipstream validate`` needs neither the
# launcher nor the planner); ``--help``, no command or an unknown one import them all.
_COMMANDS = {
    "run": "slipstream.launch.cli",
    "data": "slipstream.data.cli",
    "validate": "slipstream.job.cli",
    "render": "slipstream.job.cli",
    "submit": "slipstream.job.cli",
    "job": "slipstream.job.cli",
    "status": "slipstream.job.lifecycle.cli",
    "logs": "slipstream.job.lifecycle.cli",
    "cancel": "slipstream.job.lifecycle.cli",
    "report": "slipstream.report.cli",
    "bench": "slipstream.bench.cli",
    "plan": "slipstream.plan.cli",
    "export": "slipstream.export.cli",
}
_COMMAND_MODULES = tuple(dict.fromkeys(_COMMANDS.values()))


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``slipstream`` parser; with ``argv``, only the sub-command ``argv`` names is registered.

    Example::

        build_parser(["plan", "--help"])   # imports slipstream.plan.cli only
    """
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="slipstream",
        description="Distributed training engine on PyTorch: launch, synchronise, recover, deploy.",
    )
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    command = next((a for a in argv or () if not a.startswith("-")), None)
    modules = (_COMMANDS[command],) if command in _COMMANDS else _COMMAND_MODULES
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
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
