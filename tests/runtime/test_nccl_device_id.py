"""Every launcher binds a NCCL group to the rank's GPU (issue #42).

``init_process_group(device_id=...)`` binds the default NCCL group to one GPU:
NCCL connects eagerly at init (a bad binding fails there, not at the first
all-reduce) and torch can split subgroups off its communicator instead of
building each from scratch. Under torchrun the CPU suite saw it passed; srun,
mpirun and a single process on NCCL took other branches, never run on a GPU.
Nothing here starts a group: torch's calls are recorded (``fake_gpus``).
"""

from __future__ import annotations

import pytest
import torch

from slipstream.process import runtime
from tests.runtime.test_device_placement import fake_gpus  # noqa: F401 - the fixture

LAUNCHES = {
    "torchrun": {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
    "slurm": {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2",
              "MASTER_PORT": "29512"},
    "mpi": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_PORT": "29512"},
    "single": {},
}


@pytest.mark.parametrize("launcher", list(LAUNCHES))
def test_nccl_binds_the_group_to_the_ranks_gpu_under_every_launcher(fake_gpus, monkeypatch, launcher):  # noqa: F811
    for key in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    calls = fake_gpus(2, LAUNCHES[launcher])
    rt = runtime.init()
    assert rt.launch.launcher == launcher
    expected = torch.device("cuda", 0 if launcher == "single" else 1)
    assert (calls["backend"], rt.device) == ("nccl", expected)
    assert calls.get("device_id") == expected, f"{launcher}: NCCL group not bound to {expected}"


@pytest.mark.parametrize("launcher", list(LAUNCHES))
def test_gloo_groups_are_never_bound_even_with_cuda_tensors(fake_gpus, monkeypatch, launcher):  # noqa: F811
    for key in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "MASTER_PORT", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    calls = fake_gpus(1, {**LAUNCHES[launcher], "SLIPSTREAM_BACKEND": "gloo", "SLIPSTREAM_DEVICE": "cuda"})
    rt = runtime.init()
    assert (calls["backend"], rt.device.type) == ("gloo", "cuda")
    assert calls.get("device_id") is None
