"""Per-task GPU binding (issue #32): a rank that sees one GPU uses it; two ranks of a node
on the same physical GPU are refused by device identity, agreed over gloo after the group
starts; the node's rank count comes from Slurm's per-node counts when
SLURM_NTASKS_PER_NODE is unset. No GPU is needed: the device query is faked."""

from __future__ import annotations

import pytest
import torch

from slipstream.errors import ConfigError
from slipstream.process import runtime
from tests.runtime.test_device_placement import fake_gpus  # noqa: F401 - the fixture

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def test_a_rank_that_sees_one_gpu_uses_it():
    """srun --gpus-per-task=1 / per-rank CUDA_VISIBLE_DEVICES: 8 ranks on the node, one GPU each."""
    assert runtime.choose_device("nccl", None, 5, 8, 1, visible="5") == torch.device("cuda", 0)


def test_eight_visible_gpus_still_go_by_local_rank():
    assert runtime.choose_device("nccl", None, 5, 8, 8) == torch.device("cuda", 5)


def test_fewer_gpus_than_ranks_but_more_than_one_is_still_refused():
    with pytest.raises(ConfigError, match=r"local rank 1 of 4 on this node but only 2 GPU\(s\) visible"):
        runtime.choose_device("nccl", None, 1, 4, 2, visible="0,1")


def test_init_under_per_task_binding_uses_the_one_gpu_and_offers_its_identity(fake_gpus, monkeypatch):
    calls = fake_gpus(1, {**TORCHRUN, "CUDA_VISIBLE_DEVICES": "1"})
    monkeypatch.setattr(runtime, "visible_gpus", lambda: ("GPU-bbbb",))
    claims = []
    monkeypatch.setattr(runtime, "agree_gpu_binding", lambda claim, timeout: claims.append(claim))
    rt = runtime.init()
    assert (rt.backend, rt.device) == ("nccl", torch.device("cuda", 0))
    assert calls["device_id"] == torch.device("cuda", 0)
    assert [(c.rank, c.gpu, c.index, c.visible) for c in claims] == [(1, "GPU-bbbb", 0, "1")]


def test_init_with_eight_gpus_claims_the_local_ranks_one(fake_gpus, monkeypatch):
    fake_gpus(8, {**TORCHRUN})
    monkeypatch.setattr(runtime, "visible_gpus", lambda: tuple(f"GPU-{i}" for i in range(8)))
    claims = []
    monkeypatch.setattr(runtime, "agree_gpu_binding", lambda claim, timeout: claims.append(claim))
    assert runtime.init().device == torch.device("cuda", 1)
    assert [c.gpu for c in claims] == ["GPU-1"]


def _claim(rank, host, gpu, visible):
    return runtime.GpuClaim(rank=rank, host=host, gpu=gpu, index=0, visible=visible)


def test_two_ranks_on_one_physical_gpu_are_named():
    claims = [_claim(0, "n1", "GPU-a", "0"), _claim(1, "n1", "GPU-a", "0"),
              _claim(2, "n2", "GPU-a", "0"), _claim(3, "n2", "GPU-b", "1")]
    with pytest.raises(ConfigError) as err:
        runtime.refuse_shared_gpus(claims)
    text = str(err.value)
    assert "ranks 0, 1 on host n1 use the same GPU GPU-a" in text
    assert "CUDA_VISIBLE_DEVICES=0, 0" in text and "n2" not in text  # another host's GPU-a is another GPU
    runtime.refuse_shared_gpus(claims[2:])  # one GPU each: accepted


def _claim_and_agree(rank: int, world_size: int, gpus: list[str]) -> str:
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    claim = runtime.GpuClaim(rank=rank, host="node", gpu=gpus[rank], index=0, visible=str(rank))
    try:
        runtime.agree_gpu_binding(claim, datetime.timedelta(seconds=30))
    except ConfigError as exc:
        return str(exc)
    return ""


@pytest.mark.distributed
def test_every_rank_agrees_on_a_shared_gpu_and_refuses():
    from tests.harness import run_ranks

    shared = run_ranks(_claim_and_agree, 2, ["GPU-same", "GPU-same"], timeout_s=60)
    assert shared[0] == shared[1] and "ranks 0, 1 on host node use the same GPU GPU-same" in shared[0]
    assert run_ranks(_claim_and_agree, 2, ["GPU-x", "GPU-y"], timeout_s=60) == ["", ""]


def test_slurm_tasks_per_node_gives_the_local_count_when_ntasks_per_node_is_unset():
    """srun -N2 -n16: no SLURM_NTASKS_PER_NODE; SLURM_TASKS_PER_NODE="8(x2)" says 8 here."""
    env = runtime.detect_launch_env({"SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
                                     "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "8(x2)",
                                     "SLURM_JOB_NODELIST": "g[1-2]", "SLURM_JOB_ID": "7"})
    assert (env.local_rank, env.local_world_size, env.node_rank, env.num_nodes) == (3, 8, 1, 2)


def test_uneven_slurm_counts_take_this_nodes_entry():
    assert runtime.slurm_tasks_per_node("2(x3),1") == (2, 2, 2, 1)
    env = runtime.detect_launch_env({"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0",
                                     "SLURM_NODEID": "3", "SLURM_TASKS_PER_NODE": "2(x3),1"})
    assert env.local_world_size == 1
    with pytest.raises(ConfigError, match=r"SLURM_TASKS_PER_NODE .*got '2\(x\)'"):
        runtime.slurm_tasks_per_node("2(x)")
