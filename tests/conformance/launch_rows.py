"""The launch-environment axis of the conformance matrix, as crafted environments (pure).

Each launcher is the environment its ranks see, per rank, as the launcher sets it
(no real srun or mpirun): what :func:`slipstream.process.runtime.detect_launch_env` must
read from it, and which device :func:`slipstream.process.runtime.choose_device` must give
the rank when each node has ``node_gpus`` GPUs (or only those ``CUDA_VISIBLE_DEVICES``
lists, when the launcher binds a GPU per rank).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Expect:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: str  # under NCCL


@dataclass(frozen=True)
class Launch:
    name: str
    envs: tuple[dict, ...]   # per rank
    expect: tuple[Expect, ...]
    node_gpus: int = 2


def _torchrun(rank: int, world: int, local_world: int, **extra: str) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % local_world),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", **extra}


def _srun(rank: int, world: int, per_node: int, nodes: int, with_ntasks_per_node: bool, **extra: str) -> dict:
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(rank % per_node),
           "SLURM_NODEID": str(rank // per_node), "SLURM_NNODES": str(nodes),
           "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
           "SLURM_JOB_NODELIST": "n[1-2]" if nodes > 1 else "n1", "SLURM_JOB_ID": "4242", **extra}
    if with_ntasks_per_node:  # set only when the job asked --ntasks-per-node
        env["SLURM_NTASKS_PER_NODE"] = str(per_node)
    return env


def _ompi(rank: int, world: int, local_world: int) -> dict:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_world), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_world),
            "OMPI_MCA_ess_base_jobid": "77", **({"MASTER_ADDR": "10.0.0.1"} if local_world != world else {})}


def _pmi(rank: int, world: int, local_world: int) -> dict:
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(world), "MPI_LOCALRANKID": str(rank % local_world),
            "MPI_LOCALNRANKS": str(local_world), "PMI_JOBID": "88",
            **({"MASTER_ADDR": "10.0.0.1"} if local_world != world else {})}


def _one_node(world: int) -> tuple[Expect, ...]:
    return tuple(Expect(r, world, r, world, f"cuda:{r}") for r in range(world))


def _per_node(world: int, per_node: int, device: str | None = None) -> tuple[Expect, ...]:
    return tuple(Expect(r, world, r % per_node, per_node, device or f"cuda:{r % per_node}") for r in range(world))


def launches() -> list[Launch]:
    """Every launch environment of the axis, 2 ranks (and 4 where a layout across nodes needs it)."""
    out = [
        Launch("torchrun 1x2", tuple(_torchrun(r, 2, 2) for r in range(2)), _one_node(2)),
        Launch("torchrun 2x1", tuple(_torchrun(r, 2, 1) for r in range(2)), _per_node(2, 1)),
        # `slipstream run` starts its workers with torch's elastic agent: torchrun's variables,
        # plus the training options as SLIPSTREAM_* (checked in the matrix rows).
        Launch("slipstream run 1x2", tuple(_torchrun(r, 2, 2, SLIPSTREAM_PRECISION="bf16") for r in range(2)),
               _one_node(2)),
        Launch("srun 1x2", tuple(_srun(r, 2, 2, 1, True) for r in range(2)), _one_node(2)),
        Launch("srun 2x2", tuple(_srun(r, 4, 2, 2, True) for r in range(4)), _per_node(4, 2)),
        # srun -N2 -n4 without --ntasks-per-node: Slurm sets SLURM_TASKS_PER_NODE=2(x2) only.
        Launch("srun 2x2 SLURM_NTASKS_PER_NODE unset", tuple(_srun(r, 4, 2, 2, False) for r in range(4)),
               _per_node(4, 2)),
        Launch("srun 2x1 SLURM_NTASKS_PER_NODE unset", tuple(_srun(r, 2, 1, 2, False) for r in range(2)),
               _per_node(2, 1)),
        # srun --gpus-per-task=1: each task sees only its own GPU, as device 0.
        Launch("srun 1x2 per-rank CUDA_VISIBLE_DEVICES",
               tuple(_srun(r, 2, 2, 1, True, CUDA_VISIBLE_DEVICES=str(r)) for r in range(2)), _per_node(2, 2, "cuda:0")),
        Launch("torchrun 1x2 per-rank CUDA_VISIBLE_DEVICES",
               tuple(_torchrun(r, 2, 2, CUDA_VISIBLE_DEVICES=str(r)) for r in range(2)), _per_node(2, 2, "cuda:0")),
        Launch("mpirun (Open MPI) 1x2", tuple(_ompi(r, 2, 2) for r in range(2)), _one_node(2)),
        Launch("mpirun (Open MPI) 2x2", tuple(_ompi(r, 4, 2) for r in range(4)), _per_node(4, 2)),
        Launch("mpirun (MPICH/Intel PMI) 1x2", tuple(_pmi(r, 2, 2) for r in range(2)), _one_node(2)),
        Launch("mpirun (MPICH/Intel PMI) 2x2", tuple(_pmi(r, 4, 2) for r in range(4)), _per_node(4, 2)),
    ]
    return out


def visible_gpus(env: dict, node_gpus: int) -> int:
    """GPUs a process sees: those CUDA_VISIBLE_DEVICES lists, else every GPU of its node."""
    text = env.get("CUDA_VISIBLE_DEVICES")
    return node_gpus if text is None else len([d for d in text.split(",") if d.strip()])
