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
