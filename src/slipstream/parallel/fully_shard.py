"""Sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each layer (an entry of a top-level ``ModuleDict``/``ModuleList``, the GPT's
blocks) becomes one FSDP unit, and the root gets the rest (embeddings, final
norm, head): parameters are stored sharded over ``dp_shard`` ranks, gathered
one unit at a time for forward and backward, and gradients are reduce-scattered
so each rank keeps only its shard of gradients and optimizer state.

ZeRO stages in FSDP2 terms:

* ``zero_stage=3`` (default): ``reshard_after_forward=True``: parameters are
  freed after each unit's forward and gathered again in backward (least memory,
  two all-gathers per unit per step).
* ``zero_stage=2``: ``reshard_after_forward=False``: gathered parameters stay
  until backward (one all-gather per step, more memory). Gradients and
  optimizer state stay sharded, as in ZeRO-2. Inside a pipeline stage this is
  the default regardless (a stage runs several micro-batches back to back and
  would otherwise gather per micro-batch).
* ZeRO-1 (replicated parameters and gradients, sharded optimizer state only)
  is not something FSDP2 does: it always shards gradients with the parameters.
  torch's ``ZeroRedundancyOptimizer`` over DDP is the tool for that; Slipstream
  does not wire it (``zero_stage=1`` is refused with that explanation).

With ``dp_replicate`` > 1 as well the mesh is 2-D and FSDP2 runs HSDP: shard
inside each replica group, all-reduce between replicas. With ``dp_shard`` = 1
and tensor or pipeline parallelism, the same call gives plain replication
(DDP's arithmetic on DTensor parameters, which DDP itself does not take).

Mixed precision: ``bf16`` -> ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: the gathered parameters and the computation are bf16,
gradients are reduced and stored in fp32, master weights stay fp32; the root
casts its output back to fp32 so the loss is computed in full precision.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The layers that become their own FSDP unit: entries of top-level layer containers."""
    units = []
    for child in model.children():
        if isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            units += list(child.values() if isinstance(child, nn.ModuleDict) else child)
    return units


def apply_fully_shard(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    precision: str = "fp32",
    zero_stage: int = 3,
    in_pipeline: bool = False,
) -> nn.Module:
    """Shard ``model`` over ``dp_mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP), in place.

    Example::

        apply_fully_shard(model, dims.dp_mesh, precision="bf16", zero_stage=2)
        optimizer = torch.optim.AdamW(model.parameters())   # built after: the parameters are DTensors now
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reshard = zero_stage == 3 and not in_pipeline
    kwargs = {}
    root_kwargs = {}
    if precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
        )
    for unit in shard_units(model):
        fully_shard(unit, mesh=dp_mesh, reshard_after_forward=reshard, **kwargs)
    # The root's parameters are the last used in forward and the first in
    # backward: resharding them after forward would only gather them again.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, **root_kwargs)
    return model


def _param_groups(model: nn.Module) -> list:
    """Every FSDPParamGroup under ``model`` (one per ``fully_shard`` call that got parameters)."""
    from torch.distributed.fsdp import FSDPModule

    groups = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                groups.append(group)
    return groups


def reset_after_failure(model: nn.Module) -> None:
    """Healing in place, after the broken groups were destroyed: put FSDP2 back in the state of a
    step that never began (every parameter sharded, no collective in flight), with torch's own
    recovery call (``FSDPModule.reset_iter_state``, documented for an exception in forward or
    backward). Its results of the failed collectives are dropped first: they belong to the
    destroyed group, and waiting on them (as the reset would) raises its failure again.
    The gradients go too: the reset drops the reductions in flight, but a backward cut short
    had already given some parameters their reduced gradient, which the next backward would add
    to (the step the heal goes back to begins with none: every step ends in zero_grad(set_to_none))."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        for group in _param_groups(model):
            group._all_gather_result = None
        model._get_fsdp_state()._comm_ctx.all_gather_state = None
        model.reset_iter_state()
    for param in model.parameters():  # after the reset: the sharded parameters are the module's again
        param.grad = None


def _mesh_infos(model: nn.Module) -> list:
    """FSDP2's mesh infos under ``model``, each once: shared by a param group and its parameters,
    or a parameter's own (a custom shard placement)."""
    infos: dict[int, object] = {}
    for group in _param_groups(model):
        for holder in (group, *group.fsdp_params):
            for info in (holder.mesh_info, holder.post_forward_mesh_info):
                if info is not None:
                    infos[id(info)] = info
    return list(infos.values())


def release_groups(model: nn.Module) -> None:
    """Healing in place, once the broken groups were destroyed: FSDP2 lets go of its group objects,
    so their last references go and their sockets close: a peer blocked in a collective with this
    rank (one that is alive, and healing) then fails at once and heals too, instead of waiting out
    the collective timeout. :func:`repoint_groups` sets them again."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    for info in _mesh_infos(model):
        if isinstance(info, FSDPMeshInfo):
            info.shard_process_group = None
        if isinstance(info, DDPMeshInfo):
            info.replicate_process_group = None


def repoint_groups(model: nn.Module) -> None:
    """After the mesh formed its groups again (:meth:`~slipstream.parallel.ParallelDims.reform_groups`):
    FSDP2 resolved its process groups into objects at ``fully_shard`` time (each mesh info's
    ``shard_process_group`` / ``replicate_process_group``: its all-gathers, reduce-scatters and
    HSDP all-reduces run on them), so each is looked up again from its mesh, whose names now
    resolve to the new groups."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo, FSDPMeshInfo

    for info in _mesh_infos(model):
        if isinstance(info, FSDPMeshInfo):
            if info.reduce_scatter_process_group is not None:  # set_separate_reduce_scatter_group: not ours
                raise RuntimeError("FSDP2's separate reduce-scatter group cannot be formed again in place")
            info.shard_process_group = info.mesh.get_group(info.shard_mesh_dim)
        if isinstance(info, DDPMeshInfo):
            info.replicate_process_group = info.mesh.get_group(info.replicate_mesh_dim)
