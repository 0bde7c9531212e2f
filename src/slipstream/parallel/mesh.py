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

from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import DEGREES, TrainConfig
from ..errors import TrainingFailed


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees and the device mesh built from them."""

    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    mesh: DeviceMesh
    first_group_index: int = 0
    """torch's group counter when the mesh made its groups (their names count from it): see
    :meth:`reform_groups`."""

    @classmethod
    def build(cls, config: TrainConfig, world_size: int, device_type: str) -> ParallelDims:
        """Resolve ``config``'s degrees against ``world_size`` (ConfigError with the numbers
        when they do not multiply to it) and build the mesh with ``init_device_mesh``."""
        degrees = config.degrees(world_size)
        first = distributed_c10d._world.group_count
        mesh = init_device_mesh(device_type, tuple(degrees[d] for d in DEGREES), mesh_dim_names=DEGREES)
        _apply_run_timeout(mesh)
        return cls(mesh=mesh, first_group_index=first, **degrees)

    def release_groups(self) -> None:
        """Healing in place, before the broken default group is destroyed: the mesh lets go of the
        group objects it caches for torch.compile (it resolves names otherwise) and, on gloo, its
        own groups are destroyed first, so their sockets close now. Why first: a survivor can be
        blocked in a collective of a group that did not break (a tp group of two survivors)
        with a peer whose destroy of *every* group waits for its own in-flight work, such as
        the metrics' asynchronous all-gather on the default group, which waits for the blocked
        survivor: a deadlock until the join timeout (seen at 4 ranks, tp 2 x dp_shard 2, about
        one run in three). Closing the mesh's groups first fails the blocked one at once, and it
        heals too. (On NCCL the healer aborts every communicator instead: not done here.)
        :meth:`reform_groups` fills the cache again."""
        self.mesh._pg_registry.clear()
        default = distributed_c10d._get_default_group()
        groups = {}
        for name in self.mesh.mesh_dim_names or ():
            group = self.mesh.get_group(name)
            if group is not default and distributed_c10d.get_backend(group) == "gloo":
                groups[id(group)] = group
        for group in groups.values():
            distributed_c10d.destroy_process_group(group)

    def reform_groups(self) -> None:
        """Make the mesh's process groups again after healing in place formed a new default group
        (:mod:`slipstream.resilience.heal`; the old groups were destroyed with the old default one). A
        collective: every rank, in the same order.

        Why names: a DeviceMesh keeps its groups by *name* and looks each one up at every use
        (``get_group``, and DTensor's functional collectives pass the name), and every submesh
        (``mesh["tp"]``, FSDP2's dp mesh, a DTensor's spec) copied the root's names. Destroying the
        default group resets torch's group counter, so making the groups again in the same order
        from the counter value the mesh started at gives them the same names: every mesh object,
        wherever it is held, then resolves to the new groups, with nothing to find and rewrite.
        Where they come out under other names (on NCCL torch names a bound group's subgroups by
        their ranks, and a replacement built its mesh on the fake default group, which counts;
        or more groups were made since the heal than before the mesh), every DeviceMesh of the
        process is renamed instead (:func:`_rename_groups`). What holds group *objects* (FSDP2's
        mesh infos) is re-pointed by :func:`~slipstream.parallel.fully_shard.repoint_groups`."""
        mesh = self.mesh
        world = distributed_c10d._world
        if world.group_count <= self.first_group_index:
            world.group_count = self.first_group_index
        old = list(mesh._dim_group_names)
        names = list(DeviceMesh._init_process_groups(mesh._layout, mesh._rank_map, mesh._mesh_dim_names,
                                                     ((None, None),) * mesh.ndim))
        if names != old:
            _rename_groups(old, names)
        for name in names:  # the objects torch.compile reads (a running program resolves the names)
            mesh._pg_registry[name] = distributed_c10d._resolve_process_group(name)
        _apply_run_timeout(mesh)

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


def _rename_groups(old: list[str], new: list[str]) -> None:
    """Every DeviceMesh of this process (the root, its submeshes, FSDP2's and each DTensor's) that
    names a group of ``old`` names the group of ``new`` at the same mesh dimension instead. A scan
    of the process's objects (a submesh is a copy, held wherever it was taken): only when the
    groups could not be made again under their names."""
    import gc

    renames: dict[str, str] = {}
    for was, now in zip(old, new):
        if renames.setdefault(was, now) != now:
            raise TrainingFailed(f"the device mesh's groups formed again under names that do not map one to "
                                 f"one onto the old ones ({new}, was {old})")
    for obj in gc.get_objects():
        # (by type, not isinstance: DeviceMesh's metaclass would ask every object of the process)
        if type(obj) is DeviceMesh and hasattr(obj, "_dim_group_names"):
            obj._dim_group_names = [renames.get(name, name) for name in obj._dim_group_names]


def _apply_run_timeout(mesh: DeviceMesh) -> None:
    """Give every dimension's group the run's collective timeout.

    ``init_device_mesh`` makes its groups with the backend's default (30 min
    on gloo, 10 on NCCL) unless given backend-specific option objects; torch's
    ``_set_pg_timeout`` sets it afterwards on any backend, so a hung
    FSDP/TP/PP collective fails when the rest of the run's would.
    """
    from torch.distributed import distributed_c10d

    from ..process.runtime import group_timeout

    set_timeout = getattr(distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # an older torch: the groups keep the backend default
        return
    timeout = group_timeout()
    for name in mesh.mesh_dim_names or ():
        group = mesh.get_group(name)
        # A replacement that heals in place builds its mesh on the fake default group first (made
        # again for real in reform_groups): torch sets timeouts on gloo and NCCL groups only.
        if distributed_c10d.get_backend(group) in ("gloo", "nccl"):
            set_timeout(timeout, group)
