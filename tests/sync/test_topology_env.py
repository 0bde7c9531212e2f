"""sync.topology.detect reads the launch environment through the one parser, runtime.detect_launch_env."""

from __future__ import annotations

import pytest

from slipstream.process.runtime import detect_launch_env
from slipstream.sync.topology import Topology, detect

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)",
         "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_JOB_ID": "99"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


@pytest.mark.parametrize("env,want", [
    (TORCHRUN, Topology(3, 4, 1, 2)),
    (SLURM, Topology(5, 8, 1, 4)),
    (OPEN_MPI, Topology(1, 2, 1, 2)),
    ({"RANK": "3", "WORLD_SIZE": "4"}, Topology(3, 4, 3, 4)),  # no local figures: one node
    ({}, Topology(0, 1, 0, 1)),  # bare, no process group: a single process
])
def test_topology_is_the_launch_environment(env, want):
    got = detect(env)
    assert got == want
    launch = detect_launch_env(env)
    assert (got.node_rank, got.num_nodes) == (launch.node_rank, launch.num_nodes)


def test_topology_reports_the_parsers_errors():
    from slipstream.errors import ConfigError

    with pytest.raises(ConfigError, match="WORLD_SIZE must be an integer"):
        detect({"RANK": "0", "WORLD_SIZE": "two"})
