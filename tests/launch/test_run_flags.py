"""`slipstream run`'s flags become one typed RunFlags where they are parsed; nothing past the parse
takes (or writes into) the argparse Namespace, and LaunchOptions is filled from the flags by name."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from slipstream.cli import build_parser
from slipstream.launch.api import LaunchOptions
from slipstream.launch.cli import launch_options, launch_options_from_args, launcher_flags_type, run_flags

REPO = Path(__file__).resolve().parents[2]


def test_the_run_config_reaches_the_flags_without_writing_into_the_namespace(tmp_path):
    (tmp_path / "run.yaml").write_text("nproc_per_node: 3\nmax_restarts: 2\nprecision: bf16\n")
    args = build_parser().parse_args(["run", "--config", str(tmp_path / "run.yaml"), "--max-restarts", "0", "t.py"])
    opts = launch_options_from_args(args)
    assert (opts.nproc_per_node, opts.max_restarts) == (3, 0)  # the file, and a flag over it
    assert (args.nproc_per_node, args.max_restarts) == (1, 0)  # the parse is left as argparse made it
    flags = run_flags(args)
    assert flags.training == {"precision": "bf16"} and flags.config_launcher == ("nproc_per_node", "max_restarts")


def test_launch_options_take_every_flag_of_the_same_name():
    """A LaunchOptions field named as a launcher flag's dest is filled from it, with no copy to keep."""
    dests = {f.name for f in dataclasses.fields(launcher_flags_type())}
    shared = sorted(dests & {f.name for f in dataclasses.fields(LaunchOptions)})
    assert {"max_restarts", "tee", "heal", "virtual_local_rank", "role"} <= set(shared)
    flags = run_flags(build_parser().parse_args(["run", "t.py"]))
    changed = {"role": "trainer", "tee": "3", "log_dir": "/tmp/l", "max_restarts": 4, "virtual_local_rank": True,
               "numa_binding": "node", "signals_to_handle": "SIGTERM", "logs_specs": "x", "event_log_handler": "console"}
    flags = dataclasses.replace(flags, launcher=dataclasses.replace(flags.launcher, **changed))
    opts = launch_options(flags)
    assert {name: getattr(opts, name) for name in changed} == changed


def test_the_job_cli_hands_the_launcher_typed_flags_only():
    """job/cli.py calls launch/cli.py with RunFlags, never with the Namespace it was given."""
    tree = ast.parse((REPO / "src" / "slipstream" / "job" / "cli.py").read_text())
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "launch.cli" for a in node.names}
    given_args = [f"line {node.lineno}: {node.func.id}(args)" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported
                  and any(isinstance(a, ast.Name) and a.id == "args" for a in node.args)]
    assert imported and given_args == [f"line {n}: run_flags(args)" for n in _run_flags_lines(tree)]


def _run_flags_lines(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name) and node.func.id == "run_flags"]
