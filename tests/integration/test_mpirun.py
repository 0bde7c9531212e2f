"""Open MPI for real: `mpirun -np 2 python examples/train_gpt.py` trains through slipstream.init()
and ends with the same weights, bit for bit, as `slipstream run -n 2` with the same arguments.

mpirun sets OMPI_COMM_WORLD_* but no MASTER_ADDR/PORT: runtime.detect_launch_env
derives the rendezvous port from the MPI job id (OMPI_MCA_ess_base_jobid), so the
default port 29500 is held busy here to show that nothing depends on it.
The environment-only cases (precedence over SLURM_*, the port) are unit tests in
tests/runtime/test_runtime_mpi_env.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tests.conftest import need
from tests.harness import weights_difference

REPO = Path(__file__).resolve().parents[2]
MPIRUN = shutil.which("mpirun")
# A tiny GPT and a tiny packed corpus: the point is equality of the two launchers, not learning.
ARGS = ["--steps", "4", "--batch-size", "4", "--layers", "1", "--dim", "32", "--context", "16", "--corpus-mb", "0.2"]
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _needs_mpirun() -> None:
    need(MPIRUN is not None, "mpirun (Open MPI) is not installed (Debian: apt-get install openmpi-bin)")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCH_VARS and not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_"))}
    return {**env, "SLIPSTREAM_LOG_EVERY_STEPS": "1"}


def mpirun_argv(np: int) -> list[str]:
    """What works here (Open MPI 4.1, in a container, as root): --allow-run-as-root when
    root, --oversubscribe (2 ranks may exceed the free slots on a busy 2-core host),
    --bind-to none (as slipstream run: no core pinning of the torch threads)."""
    argv = [MPIRUN or "mpirun", "-np", str(np), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    return argv


def test_mpirun_trains_to_the_same_weights_as_slipstream_run(tmp_path):
    _needs_mpirun()
    cache = ["--data-cache", str(tmp_path / "cache")]
    ref = subprocess.run(
        [sys.executable, "-m", "slipstream", "run", "-n", "2", "examples/train_gpt.py", *ARGS, *cache,
         "--out", str(tmp_path / "run")],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-3000:]

    # The default port is busy: an mpirun rank that fell back to 29500 would fail to rendezvous.
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", 29500))
            busy.listen()
        except OSError:
            pass  # already held by someone else: busy either way
        mpi = subprocess.run(
            [*mpirun_argv(2), sys.executable, "examples/train_gpt.py", *ARGS, *cache, "--out", str(tmp_path / "mpi")],
            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert mpi.returncode == 0, mpi.stdout[-2000:] + mpi.stderr[-3000:]
    assert "2 rank(s)" in mpi.stdout and "done: 4 steps" in mpi.stdout, mpi.stdout[-2000:]
    assert (diff := weights_difference(tmp_path / "mpi" / "model.pt", tmp_path / "run" / "model.pt")) == "", diff
