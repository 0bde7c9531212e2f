import pytest

from slipstream.errors import ConfigError
from slipstream.process.runtime import _first_slurm_host, detect_launch_env


def test_torchrun_environment():
    env = detect_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                             "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.node_rank, env.num_nodes) == (
        "torchrun", 3, 4, 1, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)


def test_slurm_environment():
    env = detect_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                             "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_JOB_ID": "99"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("slurm", 5, 8, 1, 4)
    assert env.master_addr == "gpu007" and env.node_rank == 1
    again = detect_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "99"})
    assert again.master_port == env.master_port  # every task derives the same port


def test_open_mpi_and_mpich_environments():
    ompi = detect_launch_env({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                              "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (ompi.launcher, ompi.rank, ompi.local_rank) == ("mpi", 1, 1)
    mpich = detect_launch_env({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
                               "MASTER_ADDR": "node0"})
    assert (mpich.rank, mpich.world_size, mpich.node_rank, mpich.master_addr) == (2, 4, 1, "node0")


def test_mpirun_across_nodes_needs_master_addr():
    with pytest.raises(ConfigError, match="set MASTER_ADDR"):
        detect_launch_env({"PMI_RANK": "0", "PMI_SIZE": "4", "MPI_LOCALNRANKS": "2"})


def test_a_missing_local_rank_follows_consecutive_placement():
    # Ranks sit local_world_size to a node, in order: rank 3 of nodes of 2 is local rank 1.
    torchrun = detect_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert (torchrun.local_rank, torchrun.node_rank) == (1, 1)
    assert detect_launch_env({"RANK": "3", "WORLD_SIZE": "4"}).local_rank == 3  # one node
    slurm = detect_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert (slurm.local_rank, slurm.node_rank) == (1, 1)
    mpi = detect_launch_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                             "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node0"})
    assert (mpi.local_rank, mpi.node_rank) == (1, 1)


def test_no_launcher_is_a_single_process():
    env = detect_launch_env({})
    assert (env.launcher, env.rank, env.world_size) == ("single", 0, 1)


def test_bad_integer_is_named():
    with pytest.raises(ConfigError, match="WORLD_SIZE must be an integer, got 'two'"):
        detect_launch_env({"RANK": "0", "WORLD_SIZE": "two"})


@pytest.mark.parametrize("nodelist,first", [("gpu[003-005,009],cpu01", "gpu003"), ("a1,a2", "a1"), ("solo", "solo")])
def test_first_slurm_host(nodelist, first):
    assert _first_slurm_host(nodelist) == first


def test_shutdown_with_exit_code_ends_the_process_with_output_flushed():
    import subprocess
    import sys

    code = "import slipstream; slipstream.init(); print('trained', end=''); slipstream.shutdown(exit_code=3); print('not reached')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "trained"
