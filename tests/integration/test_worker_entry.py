"""`slipstream run`'s worker entry runs a script exactly as `python SCRIPT` / `python -m MODULE` would."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import json, multiprocessing, os, sys

    def square(x):  # defined in __main__: a spawned child must find it, as DataLoader workers do
        return x * x

    if __name__ == "__main__":
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            squares = pool.map(square, [2, 3])
        out = sys.argv[-1]
        with open(out, "w") as fh:
            json.dump({"name": __name__, "argv": sys.argv[:-1], "path0": sys.path[0],
                       "file": os.path.abspath(__file__), "squares": squares}, fh)
        code = int(os.environ.get("PROBE_EXIT", "0"))
        if code == 99:
            raise RuntimeError("probe failed on purpose")
        sys.exit(code)
""")
ENTRY = [sys.executable, "-m", "slipstream.launch.worker"]


def _run(argv, cwd, **env):
    import os
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def _same_under_both(tmp_path, python_args, entry_args) -> dict:
    """Run the probe as `python ARGS` and through the worker entry; both must report the same."""
    plain = _run([sys.executable, *python_args, str(tmp_path / "plain.json")], tmp_path)
    ours = _run([*ENTRY, *entry_args, str(tmp_path / "ours.json")], tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert ours.returncode == 0, ours.stderr
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "ours"))
    assert a == b
    return b


def test_a_script_sees_the_same_main_argv_path_and_file(tmp_path):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "probe.py").write_text(PROBE)
    b = _same_under_both(tmp_path, ["scripts/probe.py", "--lr", "0.1"], ["scripts/probe.py", "--lr", "0.1"])
    assert b["name"] == "__main__" and b["argv"] == ["scripts/probe.py", "--lr", "0.1"]
    assert b["path0"] == str(scripts) and b["squares"] == [4, 9]


def test_a_module_sees_the_same_main_argv_and_path(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(PROBE)
    b = _same_under_both(tmp_path, ["-m", "pkg.probe", "x"], ["--module", "pkg.probe", "x"])
    assert b["argv"] == [str(pkg / "probe.py"), "x"] and b["squares"] == [4, 9]


@pytest.mark.parametrize("probe_exit, expected", [("3", 3), ("99", 1)])
def test_exit_codes_and_errors_pass_through(tmp_path, probe_exit, expected):
    (tmp_path / "probe.py").write_text(PROBE)
    proc = _run([*ENTRY, "probe.py", str(tmp_path / "o.json")], tmp_path, PROBE_EXIT=probe_exit)
    assert proc.returncode == expected
    if expected == 1:
        assert "RuntimeError: probe failed on purpose" in proc.stderr


def test_usage_error_without_a_target():
    proc = subprocess.run([*ENTRY], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "usage: python -m slipstream.launch.worker" in proc.stderr


def test_slipstream_run_dash_m_runs_the_module_through_the_worker_entry(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(PROBE)
    proc = _run([sys.executable, "-m", "slipstream", "run", "-n", "1", "-m", "pkg.probe", "x",
                 str(tmp_path / "ours.json")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = json.loads((tmp_path / "ours.json").read_text())
    assert got["name"] == "__main__" and got["argv"] == [str(pkg / "probe.py"), "x"]
    assert got["path0"] == str(tmp_path) and got["squares"] == [4, 9]


def test_a_slipstream_error_ends_the_worker_with_one_line_its_code_and_an_error_record(tmp_path):
    """Raised before slipstream.init() (no excepthook yet): the entry reports it as the hook
    would, and leaves the line in the error file the elastic agent reads back for the launcher."""
    script = tmp_path / "bad.py"
    script.write_text("from slipstream.errors import ConfigError\nraise ConfigError('precision must be fp32, got x')\n")
    error_file = tmp_path / "error.json"
    proc = _run([*ENTRY, str(script)], tmp_path, RANK="3", TORCHELASTIC_ERROR_FILE=str(error_file))
    assert proc.returncode == 2
    assert proc.stderr == "slipstream: error (rank 3): precision must be fp32, got x\n"
    assert json.loads(error_file.read_text())["message"] == "slipstream: error (rank 3): precision must be fp32, got x"
