"""The mesh's groups formed again after a heal (ParallelDims.reform_groups) and FSDP2 re-pointed at
them (parallel.fully_shard.release_groups / repoint_groups), in one process: a heal destroys every
group with the default one and forms a new default group; these put the mesh and FSDP2 back on it.
(Across ranks, bitwise: tests/integration/test_heal_layouts.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from slipstream.config import TrainConfig
from slipstream.parallel import ParallelDims, apply_fully_shard
from slipstream.parallel.fully_shard import release_groups, repoint_groups, reset_after_failure


def _new_default_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@pytest.fixture()
def group():
    _new_default_group()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _heal() -> None:
    """What Healer.leave + rejoin do to this process's groups: all destroyed, a new default one."""
    dist.destroy_process_group()
    _new_default_group()


def test_the_mesh_and_fsdp2_move_onto_the_new_groups(group):
    dist.new_group([0])  # a group made before the mesh, as a run's side groups are
    dims = ParallelDims.build(TrainConfig(), world_size=1, device_type="cpu")
    model = apply_fully_shard(nn.Sequential(nn.Linear(4, 4)), dims.mesh["dp_shard"])
    info = model._get_fsdp_state()._fsdp_param_group.mesh_info
    before = info.shard_process_group
    model(torch.ones(2, 4)).sum().backward()

    release_groups(model)
    dims.release_groups()
    assert info.shard_process_group is None and not dims.mesh._pg_registry  # nothing holds the broken groups
    _heal()
    reset_after_failure(model)
    dims.reform_groups()
    repoint_groups(model)

    group = info.shard_process_group
    assert group is not None and group is not before
    assert group is dims.mesh["dp_shard"].get_group()  # the name a submesh copied resolves to the new group
    assert dims.mesh.get_group("dp_shard").group_name in dims.mesh._pg_registry
    model(torch.ones(2, 4)).sum().backward()  # FSDP2 runs on them


def test_a_mesh_whose_groups_come_back_under_other_names_is_renamed_everywhere(group):
    # As a replacement's mesh on NCCL: built on the fake default group (counted names), formed again
    # on the bound NCCL group (names hashed from the ranks). Here: names the mesh cannot get back.
    dims = ParallelDims.build(TrainConfig(), world_size=1, device_type="cpu")
    dims.mesh._dim_group_names = ["9"] * dims.mesh.ndim
    taken_before = dims.mesh["tp"]  # a copy of the root's names, as FSDP2 and DTensor specs hold
    _heal()
    dims.reform_groups()
    assert taken_before._dim_group_names == [dist.group.WORLD.group_name]
    assert taken_before.get_group() is dist.group.WORLD


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # FSDP2 units (shard_units)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_a_step_cut_short_leaves_no_gradient_and_every_parameter_sharded(group):
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    from slipstream.parallel.fully_shard import _param_groups

    dims = ParallelDims.build(TrainConfig(), world_size=1, device_type="cpu")
    model = apply_fully_shard(_Stack(), dims.mesh["dp_shard"])
    model(torch.ones(2, 4)).sum().backward()  # the gradients a backward cut short had already reduced
    model.layers[0].unshard()  # a unit gathered when the failure came
    _heal()
    reset_after_failure(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.sharded_state == ShardedState.SHARDED for g in _param_groups(model) for p in g.fsdp_params)
