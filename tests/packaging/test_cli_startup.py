"""The commands that need no torch do not import it (issue #15 item 4): `slipstream --help`,
`validate`, `render`, `plan --help`, `job schema`, `data --help`, `export --help`. benchmarks/cli_startup.py
times them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOBS = REPO / "examples" / "jobs"

COMMANDS = [
    ["--help"],
    ["validate", str(JOBS / "full.yaml")],
    ["render", str(JOBS / "local-2x1.yaml")],
    ["plan", "--help"],
    ["job", "schema"],
    ["data", "--help"],
    ["export", "--help"],
]

# Runs each command's main() in one fresh interpreter and reports, per command, its exit code
# and whether torch had been imported by then.
DRIVER = r"""
import contextlib, io, json, sys
from slipstream.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:  # --help
            code = exc.code
    out.append({"argv": argv, "code": code, "torch": "torch" in sys.modules})
print(json.dumps(out))
"""


def test_commands_that_need_no_torch_do_not_import_it():
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(COMMANDS)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert [r["code"] for r in results] == [0] * len(COMMANDS), results
    assert [r["argv"] for r in results if r["torch"]] == [], results


def test_import_slipstream_is_lazy_and_complete():
    """The public names resolve on first use; those of the light modules without torch. (The
    torch-side ones, accelerate and init, are what every training test calls.)"""
    code = ("import sys, slipstream, slipstream.data as d; "
            "assert set(slipstream.__all__) <= set(dir(slipstream)) and set(d.__all__) <= set(dir(d)); "
            "assert slipstream.TrainConfig.__name__ == 'TrainConfig' and slipstream.EXIT_PREEMPTED; "
            "assert issubclass(slipstream.ConfigError, slipstream.SlipstreamError); "
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "try:\n    slipstream.no_such_name\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no error')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_every_lazy_name_is_defined_where_it_points():
    import ast

    import slipstream
    import slipstream.data

    for pkg in (slipstream, slipstream.data):
        root = Path(pkg.__file__).parent
        public = set(pkg.__all__) - {"__version__"}
        assert set(pkg._LAZY) <= public
        eager = public - set(pkg._LAZY)  # bound when the package is imported (data: pack, which names its module)
        assert all(name in vars(pkg) for name in eager), sorted(n for n in eager if n not in vars(pkg))
        for name, module in pkg._LAZY.items():
            where = root.joinpath(*module.lstrip(".").split("."))  # ".process.runtime" -> process/runtime
            tree = ast.parse(where.with_suffix(".py").read_text()) if where.with_suffix(".py").exists() else (
                ast.parse((where / "__init__.py").read_text()))
            defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            defined |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
            defined |= {t.id for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign))
                        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
            assert name in defined, f"{pkg.__name__}.{name}: not in {module}"


def test_the_command_table_names_what_each_module_registers():
    """cli._COMMANDS routes a command to one module; it must match what the modules register."""
    import argparse

    from slipstream import cli

    for module in cli._COMMAND_MODULES:
        sub = argparse.ArgumentParser().add_subparsers()
        __import__(module, fromlist=["register"]).register(sub)
        assert {c for c, m in cli._COMMANDS.items() if m == module} == set(sub.choices), module


def test_a_function_named_like_its_module_stays_the_function():
    """slipstream.data.pack is the function even after the module slipstream.data.pack was imported
    (with a lazy __getattr__ alone, the submodule import would bind the module to that name)."""
    code = "import slipstream.data.pack, slipstream.data.cli\nfrom slipstream.data import pack\nassert callable(pack), pack"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
