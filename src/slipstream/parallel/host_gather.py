"""Whole tensors of a sharded model, gathered through host memory when the backend is gloo.

Why: gloo stages CUDA tensors through the host for c10d's own collectives
(``all_reduce``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``: what
DDP and FSDP2 train with), but the functional all-gather that DTensor's
``full_tensor()``/``redistribute`` use reaches gloo's coalesced all-gather,
which hands device pointers to a host copy and crashes the process with no
Python traceback (pytorch/pytorch#152645; seen on an H200 on 2026-12-04 in
``get_model_state_dict(full_state_dict=True)`` with ``--backend gloo --device
cuda``). So under gloo every shard is first copied to the host, and DTensor
reassembles it there on a CPU mesh of gloo groups made for this purpose only.
The training mesh's groups, which carry device tensors in that mode, never see
a functional all-gather (``tests/parallel/test_gloo_device_collectives.py``
checks it on every layout). Every gloo run takes this path, on the CPU too, so
the CPU suite runs the code the gloo+CUDA mode depends on. With NCCL the device
path is native and faster: ``full_tensor()`` on the device, then one copy.

The host groups are made by :meth:`HostGather.prepare`, one per slice of each
mesh dimension a parameter can be placed on, by every rank in the same order
(``new_group`` is collective), whatever parameters its pipeline stage holds.

Example::

    gather = HostGather(dims.mesh)
    gather.prepare()                                               # every rank, before the first full()
    full = {k: gather.full(v) for k, v in sharded_state.items()}   # CPU tensors, every rank
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

SHARDABLE_DIMS = ("dp_replicate", "dp_shard", "tp")
"""The mesh dimensions a parameter can be placed on (pipeline stages hold whole modules)."""


def via_host(group: Any = None) -> bool:
    """Whether gathers on ``group`` (default: the default group) go through the host:
    when its backend is gloo, whatever the device (see the module docstring).

    Example::

        via_host()   # True in a gloo run, False under NCCL
    """
    return "gloo" in str(dist.get_backend(group)).lower()


class HostGather:
    """Full tensors of DTensors on every rank, as CPU tensors (see the module docstring).

    Collective: every rank of the mesh calls :meth:`full` for the same tensors in the
    same order (as ``full_tensor()`` requires).
    """

    def __init__(self, root_mesh: DeviceMesh) -> None:
        self._root = root_mesh
        self._via_host = via_host(root_mesh.get_group(0))
        self._groups: dict[str, Any] | None = None
        self._meshes: dict[tuple, DeviceMesh] = {}

    def prepare(self) -> None:
        """Make the host groups when this run gathers through the host. Collective: every
        rank calls it before its first :meth:`full`, whatever tensors it will gather."""
        if self._via_host:
            self._host_groups()

    def full(self, value: Any) -> Any:
        """``value`` whole on the host: a DTensor gathered, a tensor copied, anything else as is."""
        from torch.distributed.tensor import DTensor

        if not isinstance(value, DTensor):
            return value.detach().cpu() if isinstance(value, torch.Tensor) else value
        if all(p.is_replicate() for p in value.placements):
            return value.to_local().detach().cpu()  # every rank holds it whole: no communication
        if not self._via_host:
            with _quiet_redistribute():
                return value.full_tensor().detach().cpu()
        host = DTensor.from_local(value.to_local().detach().cpu(), self._host_mesh(value.device_mesh), value.placements,
                                  shape=value.shape, stride=value.stride(), run_check=False)
        with _quiet_redistribute():
            return host.full_tensor()

    def _host_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        names = tuple(mesh.mesh_dim_names or ())
        key = (names, tuple(mesh.mesh.flatten().tolist()))
        found = self._meshes.get(key)
        if found is not None:
            return found
        if self._groups is None:
            raise RuntimeError("HostGather.prepare() must run on every rank before the first full()")
        groups = self._groups
        unknown = [n for n in names if n not in groups]
        if unknown:
            raise ValueError(f"a parameter is placed on mesh dimension(s) {unknown}, not one of {SHARDABLE_DIMS}")
        chosen = [groups[n] for n in names]
        made = DeviceMesh.from_group(chosen[0] if len(chosen) == 1 else chosen, "cpu",
                                     mesh=mesh.mesh, mesh_dim_names=names)
        self._meshes[key] = made
        return made

    def _host_groups(self) -> dict[str, Any]:
        """This rank's gloo group along each shardable dimension, made once (collective)."""
        if self._groups is not None:
            return self._groups
        from ..process.runtime import group_timeout

        root = self._root
        names = tuple(root.mesh_dim_names or ())
        me = dist.get_rank()
        groups: dict[str, Any] = {}
        for name in SHARDABLE_DIMS:
            if name not in names:
                continue
            axis = names.index(name)
            slices = root.mesh.movedim(axis, -1).reshape(-1, root.mesh.shape[axis]).tolist()
            for ranks in slices:  # every rank makes every slice's group, in one order
                group = dist.new_group(ranks, backend="gloo", timeout=group_timeout())
                if me in ranks:
                    groups[name] = group
        self._groups = groups
        return groups


class _SequentialGatherNote(logging.Filter):
    """Drops DTensor's note that a 2-D gather takes two sequential all-gathers (FSDP2 x TP
    parameters): true, harmless for a gather (nothing is reduced), and otherwise printed
    by every rank at every call."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential" not in str(record.msg)


@contextlib.contextmanager
def _quiet_redistribute() -> Iterator[None]:
    # A filter on DTensor's own logger, for the duration of our call only: the user's
    # logging configuration is left as it was.
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    note = _SequentialGatherNote()
    logger.addFilter(note)
    try:
        yield
    finally:
        logger.removeFilter(note)
