"""Where this rank sits: nodes, local ranks, and the process groups of each level.

Ranks are assumed to be placed ``local_world_size`` consecutive ranks per node,
as torchrun, srun and mpirun do by default. The groups are built once per
default process group and cached: ``dist.new_group`` is collective and every
rank must create groups in the same order, so :func:`groups` always builds the
flat group, then every node's intra group (node 0 first), then every inter group
(local index 0 first), on all ranks.

The rule for which group and device every collective of the sync engine uses:

* **data collectives** (gradient payloads, and the probe's timed all-reduces,
  which must measure the link the gradients take) run on ``flat``, ``intra``
  or ``inter``, which inherit the training backend (NCCL on GPUs), with
  tensors on the training device (the bucket's device);
* **host-side agreements** (probe figures, guard votes, ``auto``'s agreed
  figures and its verification) run on ``control``: one gloo group over all
  ranks, with CPU tensors, through :class:`slipstream.sync.control.ControlWire`,
  which refuses anything else. NCCL takes CUDA tensors only, so a CPU vector
  on a data group fails on GPUs; and a figure computed on the host needs no
  trip to the device and back.

Every group carries the run's collective timeout (:func:`slipstream.process.runtime.group_timeout`).

Example::

    topo = detect()                    # from the launcher's environment (slipstream.process.runtime)
    g = groups(topo)
    g.intra, g.inter                   # this rank's node group and its cross-node peer group
    g.control                          # gloo, CPU tensors: small agreements
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(
                f"world_size({self.world_size}) must be a multiple of local_world_size({self.local_world_size})"
            )
        if self.local_rank != self.rank % self.local_world_size:
            raise ValueError(
                f"local_rank({self.local_rank}) != rank({self.rank}) % local_world_size({self.local_world_size}):"
                " ranks must be placed consecutively on nodes"
            )

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.local_world_size, (node + 1) * self.local_world_size))

    def peer_ranks(self, local_index: int) -> list[int]:
        """Global ranks with local rank ``local_index``, one per node."""
        return [n * self.local_world_size + local_index for n in range(self.num_nodes)]


def detect(env: Mapping[str, str] | None = None) -> Topology:
    """Topology of this process, from the launcher's environment.

    The environment is read by :func:`slipstream.process.runtime.detect_launch_env`
    (torchrun / ``slipstream run``, Slurm, MPI). Without a launcher there, the
    runtime :func:`slipstream.init` started, else the initialised process group
    (one node), else a single process.

    Example::

        detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}).node_rank  # 1
    """
    from ..process.runtime import detect_launch_env, started

    launch = detect_launch_env(env)
    if launch.launcher == "single" and dist.is_available() and dist.is_initialized():
        rt = started()  # only if slipstream.init() started this process group
        if rt is None or rt.world_size != dist.get_world_size():
            world = dist.get_world_size()
            return Topology(dist.get_rank(), world, dist.get_rank(), world)
        launch = rt.launch
    return Topology(launch.rank, launch.world_size, launch.local_rank, launch.local_world_size)


@dataclass
class Groups:
    """Process groups of one topology. ``flat`` spans all ranks (a group of
    its own, so sync collectives never interleave with the training loop's);
    ``control`` spans all ranks too, on gloo, for host-side agreements."""

    topology: Topology
    flat: object
    intra: object  # this node's ranks
    inter: object  # this rank's peers (same local rank) on every node
    control: object = None  # gloo, CPU tensors only (see the module's rule)


_CACHE: dict[tuple, Groups] = {}


def groups(topo: Topology | None = None) -> Groups:
    """Build (once) and return the flat, intra-node and inter-node groups."""
    topo = detect() if topo is None else topo
    if topo.world_size != dist.get_world_size() or topo.rank != dist.get_rank():
        raise ValueError(
            f"topology (rank {topo.rank} of {topo.world_size}) disagrees with the process group "
            f"(rank {dist.get_rank()} of {dist.get_world_size()})"
        )
    key = (id(dist.group.WORLD), topo)
    if key in _CACHE:
        return _CACHE[key]
    from ..process.runtime import group_timeout

    timeout = group_timeout()
    flat = dist.new_group(list(range(topo.world_size)), timeout=timeout)
    intra = inter = None
    # Same order on every rank: all node groups, then all peer groups, then control.
    for node in range(topo.num_nodes):
        g = dist.new_group(topo.node_ranks(node), timeout=timeout)
        if node == topo.node_rank:
            intra = g
    for local_index in range(topo.local_world_size):
        g = dist.new_group(topo.peer_ranks(local_index), timeout=timeout)
        if local_index == topo.local_rank:
            inter = g
    control = dist.new_group(list(range(topo.world_size)), backend=_control_backend(), timeout=timeout)
    _CACHE[key] = Groups(topo, flat, intra, inter, control)
    return _CACHE[key]


def _control_backend() -> str | None:
    """gloo; None (the default group's backend) in a replacement healing in place until it joined
    the survivors: its default group is a fake one there, and a gloo group would wait for peers
    that are not making it (:meth:`slipstream.resilience.heal.Healer.side_group_backend`)."""
    from ..resilience import heal

    return heal.side_group_backend()


def forget() -> None:
    """Drop every cached group (healing in place: the default group they were made under was
    destroyed). The cache is keyed by the default group's ``id()``, which a new default group
    may reuse once the old one is freed, so it is cleared, not left to miss. The next
    :func:`groups` builds them again, a collective in the same order on every rank."""
    _CACHE.clear()
