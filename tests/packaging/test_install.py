"""scripts/install.sh never replaces the installed torch, and installs what the tests need.

The script's own pip calls run here with `--dry-run --report` (SLIPSTREAM_PIP_REPORT_DIR):
pip resolves them against this environment, with the script's constraints, and reports
what it would install, which must not include torch. The full check in a fresh venv
(install.sh, then install.sh test: one torch, the one installed first) is by hand; see
docs/install.md, Set up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_install_sh_test_keeps_torch(tmp_path):
    # No build isolation: the editable metadata is built with the setuptools installed here
    # (>= 77, as install.sh test installs it) instead of a fresh one, which saves a download.
    env = {**os.environ, "SLIPSTREAM_PIP_REPORT_DIR": str(tmp_path), "PYTHON": sys.executable,
           "PIP_NO_BUILD_ISOLATION": "0"}
    proc = subprocess.run(["bash", "scripts/install.sh", "test"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    reports = sorted(tmp_path.glob("pip-*.json"))
    assert len(reports) == 2, reports  # the package with [all], then the test group
    for report in reports:
        installs = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
        assert "torch" not in installs and not any(n.startswith("nvidia-") for n in installs), (report.name, installs)


def test_test_dependencies_cover_every_extra():
    """install.sh test installs .[all] and the test group: all must gather every extra."""
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = meta["project"]["optional-dependencies"]
    (gathered,) = extras["all"]
    names = set(gathered.split("[", 1)[1].rstrip("]").split(","))
    assert names == set(extras) - {"all"}
    assert {"hf", "wandb", "mlflow"} <= names
    groups = meta["dependency-groups"]
    assert not any("deepspeed" in r.lower() for reqs in extras.values() for r in reqs)  # a benchmark peer only
    assert any(r.startswith("deepspeed") for r in groups["bench"])
    assert any(r.startswith("pytest") for r in groups["test"])
    script = (REPO / "scripts" / "install.sh").read_text()
    assert 'test) target=".[all]"' in script


def test_the_package_ships_license_and_py_typed():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0" and meta["project"]["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text().split("\n", 3)[1]
    assert (REPO / "src" / "slipstream" / "py.typed").exists()
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["slipstream"]
