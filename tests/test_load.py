"""The load harness (tests/load.py): rounds beside CPU-bound neighbours, pass rates and spreads."""

from __future__ import annotations

import os

import pytest

from tests import load

FLAKY = '''
import os, pathlib

def test_steady():
    pass

def test_fails_on_the_second_round():
    n = pathlib.Path(os.environ["ROUNDS_FILE"])
    seen = int(n.read_text()) if n.exists() else 0
    n.write_text(str(seen + 1))
    assert seen != 1, "the second round"
'''


def test_rounds_beside_neighbours_count_each_tests_passes_and_name_the_first_failure(tmp_path, monkeypatch, capsys):
    (tmp_path / "test_flaky.py").write_text(FLAKY)
    monkeypatch.setenv("ROUNDS_FILE", str(tmp_path / "rounds"))
    code = load.main(["-n", "1", "-r", "3", "--out", str(tmp_path / "out"), "--", str(tmp_path / "test_flaky.py")])
    out = capsys.readouterr().out
    assert code == 1, out  # one failed run makes the harness fail
    assert "3 rounds beside 1 CPU-bound neighbour(s)" in out
    lines = {line.split()[-1].split("::")[-1]: line for line in out.splitlines() if "passed" in line and "::" in line}
    assert lines["test_steady"].startswith("3/3 passed"), lines
    assert lines["test_fails_on_the_second_round"].startswith("2/3 passed"), lines
    assert "first failure: AssertionError: the second round" in out, out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["round-00", "round-01", "round-02"]
    # The neighbours are gone: no process still spins with the harness's loop.
    spinning = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if load.SPIN.encode() in f.read():
                    spinning.append(pid)
        except OSError:
            pass
    assert spinning == []


def test_no_tests_named_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        load.main(["-r", "2"])
    assert exc.value.code == 2
    assert "name the tests after --" in capsys.readouterr().err
