"""The launch-environment axis, crossed with the layouts: every launcher's variables, per rank (pure).

What each launcher sets is crafted in tests/conformance/launch_rows.py; the
one parser (slipstream.process.runtime.detect_launch_env), the device choice and the
topology the hierarchical sync reads must agree with what the launcher meant.
"""

from __future__ import annotations

import pytest

from slipstream.config import TrainConfig
from slipstream.process.runtime import choose_device, detect_launch_env
from slipstream.sync.topology import detect as detect_topology
from tests.conformance.launch_rows import launches, visible_gpus
from tests.conformance.matrix import LAYOUTS

LAUNCHES = launches()


@pytest.mark.parametrize("launch", LAUNCHES, ids=[launch.name for launch in LAUNCHES])
def test_each_rank_reads_where_it_sits_and_binds_its_gpu(launch):
    for env, expect in zip(launch.envs, launch.expect):
        got = detect_launch_env(env)
        where = (got.rank, got.world_size, got.local_rank, got.local_world_size)
        assert where == (expect.rank, expect.world_size, expect.local_rank, expect.local_world_size), (
            f"{launch.name}: rank {expect.rank} read (rank, world, local_rank, local_world) = {where}")
        topo = detect_topology(env)
        assert topo.local_world_size == expect.local_world_size, f"{launch.name}: topology {topo}"
        gpus = visible_gpus(env, launch.node_gpus)
        device = choose_device("nccl", None, got.local_rank, got.local_world_size, gpus, env.get("CUDA_VISIBLE_DEVICES"))
        assert str(device) == expect.device, f"{launch.name}: rank {expect.rank} seeing {gpus} GPU(s) got {device}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("launch", LAUNCHES, ids=[launch.name for launch in LAUNCHES])
def test_every_layout_fits_the_world_each_launcher_reads(launch, layout):
    world = detect_launch_env(launch.envs[0]).world_size
    # The options as `slipstream run` passes them (SLIPSTREAM_*), over the launcher's own variables.
    env = {**launch.envs[0], **TrainConfig(**LAYOUTS[layout]).to_env()}
    cfg = TrainConfig.from_env(env)
    degrees = cfg.degrees(world)
    assert degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"] * degrees["pp"] == world
    if launch.name.startswith("slipstream run"):
        assert cfg.numerics.precision == "bf16"
