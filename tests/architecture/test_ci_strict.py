"""Under CI every test runs: one helper decides what a missing need does.

tests/conftest.py's :func:`~tests.conftest.need` (and ``need_module``,
``need_command``, ``require_root``) skips locally and fails under ``CI``; a
test that no install can enable calls ``cannot_run_here``, listed below with
its reason. This module checks the helper itself, and scans tests/ for any
other way to skip (``importorskip``, ``pytest.skip``, ``skipif``, ``xfail``,
a private reading of ``CI``), so the rule stays kept.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import conftest
from tests.conftest import cannot_run_here, need, need_command, need_module, require_root

TESTS = Path(__file__).resolve().parents[1]

# Ways to skip or to read CI outside tests/conftest.py (built so this file's own text
# does not match them).
_SKIP = "sk" + "ip"
FORBIDDEN = {
    "importor" + _SKIP: re.compile(r"\bimportor" + _SKIP + r"\b"),
    "pytest." + _SKIP + "(": re.compile(r"\bpytest\s*\.\s*" + _SKIP + r"\s*\("),
    _SKIP + "if": re.compile(r"\b" + _SKIP + r"if\b"),
    "mark." + _SKIP: re.compile(r"\bmark\s*\.\s*" + _SKIP + r"\b"),
    "unittest." + _SKIP: re.compile(r"\bunittest\s*\.\s*" + _SKIP),
    "xfail": re.compile(r"\bxfail\b"),
    "a private reading of CI": re.compile(r"""environ\s*(\.\s*get\s*\(|\[)\s*["']CI["']"""),
    "IN_CI defined again": re.compile(r"^\s*IN_CI\s*=", re.M),
}

# Every cannot_run_here: a skip no install can lift (a visible GPU, another OS), CI included.
CANNOT_RUN_HERE = {
    "plan/test_plan_cli.py": 1,  # a GPU is visible: the probe-memory error cannot happen
    "integration/test_gpu_acceptance.py": 1,  # a GPU is visible: asking for CUDA does not fail
    "runtime/test_gloo_exit.py": 1,  # no Linux /proc, or a machine whose futex syscall is unknown
    "launch/test_safe_signals.py": 1,  # not Linux
    "launch/test_parent_death.py": 1,  # not Linux
}


def offences(path: Path, text: str) -> list[str]:
    """Each forbidden use in ``text`` (the file at ``path``), as 'path:line: what'."""
    out = []
    for what, pattern in FORBIDDEN.items():
        for m in pattern.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append(f"{path}:{line}: {what}")
    return out


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_skip_outside_the_helper():
    found = []
    for p in _test_files():
        if p in (TESTS / "conftest.py", Path(__file__).resolve()):
            continue
        found += offences(p.relative_to(TESTS), p.read_text())
    assert found == [], ("skip or fail through tests/conftest.py's need()/need_module()/need_command()/"
                         "require_root() (cannot_run_here() for what no install changes):\n" + "\n".join(found))


def test_every_cannot_run_here_is_listed():
    uses = {}
    for p in _test_files():
        if p in (TESTS / "conftest.py", Path(__file__).resolve()):
            continue
        n = len(re.findall(r"\bcannot_run_here\s*\(", p.read_text()))
        if n:
            uses[str(p.relative_to(TESTS))] = n
    assert uses == CANNOT_RUN_HERE


@pytest.mark.parametrize("snippet", [
    'x = pytest.importor' + _SKIP + '("s3fs")',
    '@pytest.mark.' + _SKIP + 'if(True, reason="no")',
    'pytestmark = pytest.mark.' + _SKIP + '',
    '    pytest.' + _SKIP + '("kubectl is not installed")',
    'if os.environ.get("CI") == "true":',
    'IN_CI = True',
    '@pytest.mark.xfail',
])
def test_the_scan_catches_each_way_to_skip(snippet):
    assert offences(Path("t.py"), "import pytest\n\n" + snippet + "\n") != []


def test_the_scan_passes_the_helper():
    assert offences(Path("t.py"), 'need_command("kubectl")\nmod = need_module("s3fs")\nrequire_root()\n') == []


# -- the helper ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["true", "1", "yes", "TRUE", "True"])
def test_a_missing_need_fails_under_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    assert conftest.in_ci()
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        need(False, "needs a thing")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_for_slipstream"):
        need_module("no_such_module_for_slipstream")
    with pytest.raises(pytest.fail.Exception, match="no-such-command-for-slipstream"):
        need_command("sh", "no-such-command-for-slipstream")


@pytest.mark.parametrize("value", [None, "", "false", "0"])
def test_a_missing_need_skips_outside_ci(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not conftest.in_ci()
    with pytest.raises(pytest.skip.Exception, match="needs a thing"):
        need(False, "needs a thing")
    with pytest.raises(pytest.skip.Exception):
        need_module("no_such_module_for_slipstream")
    with pytest.raises(pytest.skip.Exception):
        need_command("no-such-command-for-slipstream")


@pytest.mark.parametrize("value", ["true", ""])
def test_a_met_need_returns_what_was_asked(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    need(True, "never said")
    assert need_module("json").dumps([1]) == "[1]"
    assert need_command("sh")[0].endswith("/sh")


def test_root_is_a_need(monkeypatch):
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(conftest.os, "geteuid", lambda: 1000)
    with pytest.raises(pytest.fail.Exception, match="needs root"):
        require_root()


def test_cannot_run_here_skips_under_ci_too(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.skip.Exception, match="cannot run on this machine, CI included: a GPU"):
        cannot_run_here("a GPU is visible")
