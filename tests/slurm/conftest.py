"""The real two-node Slurm cluster of scripts/slurm_cluster.sh (n1, n2 on this host), started once per session.

Skipped without Slurm or root; under CI=true (.ci/run installs Slurm and runs as root) they must run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import need

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = os.environ.get("SLIPSTREAM_SLURM_DIR", "/tmp/slipstream-slurm")


@pytest.fixture(scope="session")
def slurm_conf() -> str:
    """Path of the running cluster's slurm.conf (``scripts/slurm_cluster.sh start`` is idempotent)."""
    missing = [t for t in ("slurmctld", "slurmd", "munged", "sbatch", "srun") if shutil.which(t) is None]
    why = f"Slurm is not installed ({', '.join(missing)} missing)" if missing else (
        "needs root (slurmd runs jobs as their user)" if os.geteuid() != 0 else None)
    need(why is None, str(why))
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm_cluster.sh"), "start"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return os.path.join(SLURM_DIR, "slurm.conf")


@pytest.fixture(scope="session")
def slurm_env(slurm_conf, tmp_path_factory) -> dict[str, str]:
    """The environment for Slurm commands and ``slipstream`` subprocesses (submission records in a temp dir)."""
    return {**os.environ, "SLURM_CONF": slurm_conf,
            "SLIPSTREAM_STATE_DIR": str(tmp_path_factory.mktemp("slipstream-state"))}
