"""How mpirun's environment is read (the real mpirun run is tests/integration/test_mpirun.py)."""

from __future__ import annotations

import pytest

from slipstream.errors import ConfigError
from slipstream.process.runtime import DEFAULT_PORT, detect_launch_env, port_for_job

# What Open MPI 4.1's mpirun -np 2 sets for rank 1 on one node (seen here), less the noise.
OMPI_RANK1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
              "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1891237889",
              "PMIX_NAMESPACE": "1891237889", "PMIX_RANK": "1"}


def test_one_node_mpirun_rendezvous_on_localhost_at_a_port_of_its_job():
    env = detect_launch_env(OMPI_RANK1)
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("mpi", 1, 2, 1)
    assert env.master_addr == "127.0.0.1"
    assert env.master_port == port_for_job("1891237889") != DEFAULT_PORT
    assert 20000 <= env.master_port < 40000
    other = detect_launch_env({**OMPI_RANK1, "OMPI_MCA_ess_base_jobid": "1891303425"})
    assert other.master_port != env.master_port  # two mpiruns on one node do not collide


def test_master_addr_and_port_given_win():
    env = detect_launch_env({**OMPI_RANK1, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("10.0.0.5", 1234)


def test_open_mpi_wins_over_the_slurm_variables_its_daemons_pass_on():
    """mpirun inside sbatch: orted is started by srun, and every rank inherits the
    daemon's SLURM_PROCID (its node index). The Open MPI rank is the true one; across
    nodes rank 0 sits on the allocation's first node."""
    env = detect_launch_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                             "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "77",
                             "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "12",
                             "SLURM_JOB_NODELIST": "gpu[003-004]"})
    assert (env.launcher, env.rank, env.world_size, env.node_rank) == ("mpi", 3, 4, 1)
    assert env.master_addr == "gpu003" and env.master_port == port_for_job("77")


def test_mpirun_across_nodes_outside_slurm_needs_master_addr():
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        detect_launch_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_srun_with_pmi2_stays_a_slurm_launch():
    """srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE beside SLURM_*: the Slurm reading knows the nodes."""
    env = detect_launch_env({"PMI_RANK": "2", "PMI_SIZE": "4", "SLURM_PROCID": "2", "SLURM_NTASKS": "4",
                             "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "9"})
    assert (env.launcher, env.rank, env.master_addr, env.master_port) == ("slurm", 2, "n1", port_for_job("9"))
