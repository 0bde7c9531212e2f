"""The user errors of issue #36 one by one, misspelt names across every command, and the
cases that need real processes: a configuration error in one rank of two, and the
command as a user runs it (``python -m slipstream``), where a traceback would show."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
CONFIG_ERROR = REPO / "tests" / "integration" / "scripts_config_error.py"
CONFIG_MESSAGE = "checkpoint_dir exists and is not a directory: /no/such/ckpt (on purpose)"


def _run_main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.py").write_text("print('ran')\n")
    import torch.distributed.launcher.api as launcher_api

    def tripwire(*args, **kwargs):
        raise AssertionError("a worker would start")

    monkeypatch.setattr(launcher_api, "elastic_launch", tripwire)
    return "ok.py"


@pytest.mark.parametrize("argv, words", [
    (["run", "-m", "no_such_module"], ["-m/--module", "no_such_module"]),
    (["run", "--nproc-per-nod", "2", "ok.py"], ["--nproc-per-nod", "did you mean --nproc-per-node?"]),
    (["run", "--sync", "powersdg", "ok.py"], ["powersdg", "did you mean 'powersgd'?"]),
    (["run", "--sync", "powersgd", "--sync-options", '{"rnk": 4}', "ok.py"], ["rnk", "did you mean 'rank'?"]),
    (["run", "--master-port", "99999", "ok.py"], ["--master-port", "99999"]),
    (["run", "--prometheus-port", "abc", "ok.py"], ["--prometheus-port", "abc"]),
    (["run", "--link", "1gbit", "ok.py"], ["--link", "--emulate"]),
    (["plan", "--model", "gpt-125m", "--gpus", "8", "--gpu-type", "H100", "--network", "400GB-ib"],
     ["--network", "400GB-ib", "400gbit-ib", "known forms"]),
    (["rn", "ok.py"], ["did you mean 'run'?"]),
])
def test_each_listed_error_is_one_line_and_exit_2(argv, words, script, capsys):
    code, err = _run_main(argv, capsys)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err  # the error, then "(see ... --help)"
    for word in words:
        assert word in err, err


def test_numa_binding_without_cuda_is_refused_before_launch(script, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU-only case, on any machine
    code, err = _run_main(["run", "--numa-binding", "node", "ok.py"], capsys)
    assert code == 2 and "--numa-binding node" in err and "CUDA" in err and "Traceback" not in err, err


def test_report_without_matplotlib_names_the_extra_and_the_torch_pin(tmp_path, monkeypatch, capsys):
    import importlib.util
    from importlib.metadata import version

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code, err = _run_main(["report", str(tmp_path)], capsys)
    assert code == 2, err
    assert f"pip install 'slipstream[metrics]' 'torch=={version('torch')}'" in err, err


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*path, name))
    if path:
        yield path, parser


MISSPELT = [pytest.param(path, option, id=f"{' '.join(path)} {option}")
            for path, parser in _subcommands(build_parser())
            for option in [next((s for a in parser._actions for s in a.option_strings
                                 if s.startswith("--") and len(s) > 6 and s != "--help"), None)]
            if option is not None]


@pytest.mark.parametrize("path, option", MISSPELT)
def test_a_misspelt_option_of_every_command_gets_a_suggestion(path, option, script, capsys):
    """The first long option of every command, its last letter dropped: an unknown option
    (prefix abbreviations are off), named with the option meant."""
    code, err = _run_main([*path, option[:-1], "x", "ok.py"], capsys)
    assert code == 2, err
    assert f"did you mean {option}?" in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2, err


def _slipstream(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "slipstream", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_sync_options_are_checked_before_any_worker_starts(tmp_path):
    """As a user runs it: one line, exit 2, and the script never ran (it prints 'ran')."""
    (tmp_path / "ok.py").write_text("print('ran')\n")
    proc = _slipstream("run", "--sync", "powersgd", "--sync-options", '{"rnk": 4}', "ok.py", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "did you mean 'rank'?" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "ran" not in proc.stdout


def test_a_configuration_error_in_one_rank_is_reported_once_and_the_other_rank_prints_no_traceback(tmp_path):
    """Rank 0 raises a ConfigError while rank 1 waits in an all-reduce for it: rank 1's
    collective fails with gloo's 'Connection closed by peer', which printed a 30-line
    traceback. Now it ends in one line, and the error's message appears once, in the
    launcher's report. --monitor-interval 5: rank 1 sees the closed connection long before
    the agent would stop it, even on a loaded machine."""
    proc = _slipstream("run", "-n", "2", "--monitor-interval", "5", str(CONFIG_ERROR), "--only-rank", "0",
                       cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert out.count(CONFIG_MESSAGE) == 1, out[-3000:]
    assert "slipstream: rank 1 stopped at scripts_config_error.py:" in out and "lost its peer" in out, out[-3000:]
