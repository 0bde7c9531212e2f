"""Rules of the parallel layouts' groups: the run's timeout on every group (the device mesh's
dimensions, the pipeline's tied weights), and no pipeline over gloo with CUDA tensors."""

from __future__ import annotations

from tests.harness import run_ranks

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


def test_a_pipeline_over_gloo_with_cuda_tensors_is_refused(monkeypatch):
    """gloo's send/recv read the tensor's pointer on the host: GPU memory would crash the rank."""
    import pytest
    import torch

    from slipstream.errors import ConfigError
    from slipstream.parallel import pipeline

    monkeypatch.setattr(pipeline.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(pipeline.dist, "get_backend", lambda group=None: "gloo")
    with pytest.raises(ConfigError, match="send/recv cannot carry GPU memory"):
        pipeline.check_p2p_device(torch.device("cuda", 0), object())
    pipeline.check_p2p_device(torch.device("cpu"), object())  # gloo on the CPU is fine
    monkeypatch.setattr(pipeline.dist, "get_backend", lambda group=None: "nccl")
    pipeline.check_p2p_device(torch.device("cuda", 0), object())
