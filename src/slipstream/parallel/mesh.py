"""The device mesh of a parallel layout: one named dimension per degree.

Dimensions, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``.
Tensor parallelism is innermost so its ranks are consecutive (on GPUs: the
same node, where its per-layer collectives need the fast links); pipeline
stages are outermost (point-to-point only, the least bandwidth).

Example::

    dims = ParallelDims.build(TrainConfig(dp_shard=2, tp=2), world_size=4, device_type="cpu")
    dims.mesh["tp"].size()        # 2
    dims.dp_rank, dims.dp_size    # which slice of the global batch this rank feeds
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import DEGREES, TrainConfig


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees and the device mesh built from them."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    mesh: DeviceMesh

    @classmethod
    def build(cls, config: TrainConfig, world_size: int, device_type: str) -> ParallelDims:
        """Resolve ``config``'s degrees against ``world_size`` (ConfigError with the numbers
        when they do not multiply to it) and build the mesh with ``init_device_mesh``."""
        degrees = config.degrees(world_size)
        mesh = init_device_mesh(device_type, tuple(degrees[d] for d in DEGREES), mesh_dim_names=DEGREES)
        _apply_run_timeout(mesh)
        return cls(mesh=mesh, **degrees)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each feeds its own slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index (ranks of one TP group or one pipeline share it)."""
        return self.mesh.get_local_rank("dp_replicate") * self.dp_shard + self.mesh.get_local_rank("dp_shard")

    @property
    def pp_rank(self) -> int:
        return self.mesh.get_local_rank("pp")

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The (dp_replicate, dp_shard) submesh: FSDP2's mesh (HSDP when both are > 1)."""
        return self.mesh["dp_replicate", "dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    def describe(self) -> str:
        return f"pp({self.pp}) x dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}) x tp({self.tp})"


def _apply_run_timeout(mesh: DeviceMesh) -> None:
    """Give every dimension's group the run's collective timeout.

    ``init_device_mesh`` makes its groups with the backend's default (30 min
    on gloo, 10 on NCCL) unless given backend-specific option objects; torch's
    ``_set_pg_timeout`` sets it afterwards on any backend, so a hung
    FSDP/TP/PP collective fails when the rest of the run's would.
    """
    from torch.distributed import distributed_c10d

    from ..runtime import group_timeout

    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # an older torch: the groups keep the backend default
        return
    timeout = group_timeout()
    for name in mesh.mesh_dim_names or ():
        set_timeout(timeout, mesh.get_group(name))
