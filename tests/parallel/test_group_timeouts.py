"""Every group of a parallel layout (the device mesh's dimensions, the pipeline's tied
weights) carries the run's collective timeout, not the backend's 30-minute default."""

from __future__ import annotations

from harness import run_ranks

TIMEOUT_S = 77.0


def _mesh_timeouts(rank: int, world: int) -> list[float]:
    import torch

    import slipstream
    from slipstream.config import TrainConfig
    from slipstream.parallel.mesh import ParallelDims

    slipstream.init(backend="gloo")
    dims = ParallelDims.build(TrainConfig(dp_shard=1, tp=2), world, "cpu")
    out = []
    for name in dims.mesh.mesh_dim_names:
        group = dims.mesh.get_group(name)
        out.append(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    return out


def test_device_mesh_groups_carry_the_run_timeout():
    results = run_ranks(_mesh_timeouts, 2, env={"SLIPSTREAM_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)})
    for timeouts in results:
        assert timeouts and set(timeouts) == {TIMEOUT_S}
