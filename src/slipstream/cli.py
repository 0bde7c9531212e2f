"""The ``slipstream`` command: one sub-command per module.

Each module in ``_COMMAND_MODULES`` provides ``register(subparsers)``, which
adds its parser and sets ``func`` to a ``main(args) -> int`` that turns the
arguments into a typed request (``LaunchOptions``, ``JobRun``, ...) and calls down.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import NoReturn

from .errors import EXIT_INTERRUPTED, EXIT_USAGE, SlipstreamError, did_you_mean

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
    "env": "slipstream.env_report.cli",
}
_COMMAND_MODULES = tuple(dict.fromkeys(_COMMANDS.values()))


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every ``slipstream`` command (sub-commands inherit it through
    ``add_subparsers``): a usage error is one line naming the option, the rule and the
    value, plus a pointer to ``--help``, and exit 2, instead of the full usage (41 lines
    for ``run``) before the error. An unknown option or choice gets the closest known one
    ("did you mean --nproc-per-node?").

    Prefix abbreviations are off (``allow_abbrev=False``): with them, ``--gpu`` meant
    ``--gpus`` until an option ``--gpu-type`` made it ambiguous, and ``run``'s own flags
    could swallow a script's; the suggestion gives the full name instead.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._argv: list[str] = []

    def parse_known_args(self, args=None, namespace=None):  # argparse's signature
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _innermost(self) -> ArgumentParser:
        """The sub-command parser the arguments chose (``slipstream data pack ...`` -> data pack's)."""
        parser: argparse.ArgumentParser = self
        for word in self._argv:
            subparsers = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
            if subparsers is None:
                break
            if word in subparsers.choices:
                parser = subparsers.choices[word]
        return parser if isinstance(parser, ArgumentParser) else self

    def _option_strings(self) -> list[str]:
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        parser = self._innermost() if message.startswith("unrecognized arguments: ") else self
        if message.startswith("unrecognized arguments: "):
            words = message[len("unrecognized arguments: "):].split()
            options = parser._option_strings()
            named = [w + did_you_mean(w.split("=", 1)[0], options) if w.startswith("--") else w for w in words]
            unknown = [w for w in words if w.startswith("-")]
            message = ("unknown option" + ("s" if len(unknown) > 1 else "") + ": " if unknown and len(unknown) == len(words)
                       else "unrecognized arguments: ") + " ".join(named)
        elif message.startswith("the following arguments are required"):
            # A misspelt required option (--cach) shows up as the right one missing: say both.
            unknown = [w.split("=", 1)[0] for w in self._argv if w.startswith("--") and w != "--"
                       and w.split("=", 1)[0] not in self._option_string_actions]
            if unknown:
                message += "; unknown option" + ("s" if len(unknown) > 1 else "") + ": " + " ".join(
                    w + did_you_mean(w, self._option_strings()) for w in unknown)
        else:
            found = re.search(r"invalid choice: '(.*?)' \(choose from (.*)\)$", message)
            if found:
                choices = re.findall(r"'([^']*)'", found.group(2))
                message += did_you_mean(found.group(1), choices, quote=True)
        self.exit(2, f"{parser.prog}: error: {message}\n(see '{parser.prog} --help')\n")


class _VersionAction(argparse.Action):
    """``--version``: worked out when asked (reading torch's version costs nothing on a CPU
    build; CUDA's NCCL needs torch imported), not when every other command builds its parser."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)  # type: ignore[arg-type]

    def __call__(self, parser, namespace, values, option_string=None) -> NoReturn:  # argparse's signature
        from .env_report import version_line

        print(version_line())  # on stdout, as argparse's own version action prints
        parser.exit(0)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``slipstream`` parser; with ``argv``, only the sub-command ``argv`` names is registered.

    Example::

        build_parser(["plan", "--help"])   # imports slipstream.plan.cli only
    """
    parser = ArgumentParser(
        prog="slipstream",
        description="Distributed training engine on PyTorch: launch, synchronise, recover, deploy.",
    )
    parser.add_argument("--version", action=_VersionAction,
                        help="print the versions of slipstream, torch and Python (and CUDA and NCCL, where torch has them)")
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


def _command(args: argparse.Namespace):
    """The sub-command's ``main``. ``slipstream run JOB.yaml`` is the job runner's and
    ``slipstream run SCRIPT`` the launcher's: the choice is made here, above both tools, so
    the launcher never imports the job package (job -> launch is the one direction)."""
    if args.command == "run":
        from .job.spec import is_job_file

        if is_job_file(args.script):
            from .job.cli import run_main

            return run_main
        _check_script_extras(args)
    return args.func


def _check_script_extras(args: argparse.Namespace) -> None:
    """A script that imports what an extra provides (transformers' Trainer, Accelerate, Lightning)
    while it is missing here: one line naming the extra, exit 2, before any worker starts, instead
    of the same ImportError in every rank ("requires accelerate>=1.1.0"). A text search of the
    script, no import; a module (-m), a program (--no-python) or an unreadable file is left to the worker."""
    import os

    from .errors import UsageError
    from .extras import script_missing_extra

    if getattr(args, "module", False) or getattr(args, "no_python", False) or not os.path.isfile(args.script):
        return
    try:
        with open(args.script, encoding="utf-8", errors="replace") as fh:
            source = fh.read(1 << 20)  # a training script is far smaller; the imports are at the top
    except OSError:
        return
    missing = script_missing_extra(source, args.script)
    if missing is not None:
        raise UsageError(missing)


def entrypoint() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entrypoint()
