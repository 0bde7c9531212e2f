"""Apply a parallel layout to a model, in one order.

The order, and why:

1. **pipeline split** (pp > 1): this rank keeps its stage's modules only
   (a deep copy with the other stages' modules deleted, names unchanged).
   First, so every later step works on the smaller stage.
2. **move to the device**.
3. **tensor parallel** (tp > 1): the plan's Linear layers become DTensors
   sharded over the ``tp`` mesh dimension, and every other parameter a
   DTensor replicated over it (:mod:`.replicate`: foreach and fused optimizers
   refuse a mix of DTensors and plain tensors). Before FSDP, which then shards
   these DTensors once more over ``dp_shard`` (2-D parameters, one mesh).
4. **activation checkpointing** of the configured module types. After TP (the
   plan names the original modules) and before FSDP (whose units are the
   wrapped layers, so recomputation re-gathers nothing twice).
5. **data parallel**: FSDP2 ``fully_shard`` over the (dp_replicate, dp_shard)
   mesh when any data parallelism is combined with sharding, TP or PP
   (HSDP when both dp degrees are > 1; replication when dp_shard is 1). Pure
   replication over every rank (the default layout) does not come here: it
   stays on Slipstream's DDP path with its gradient-sync strategies. With
   ``sync diloco`` the caller passes the ``dp_shard`` mesh alone (``dp_mesh``):
   FSDP2 then shards and reduces inside each replica only, and DiLoCo's outer
   step joins the replicas over ``dp_replicate``.

Example::

    dims = ParallelDims.build(config, world_size, "cpu")
    layout = parallelize(model, config, dims, tp_plan=GPT_TP_PLAN, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(layout.module.parameters())
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import TrainConfig
from ..errors import ConfigError
from .activation_checkpointing import apply_activation_checkpointing
from .fully_shard import apply_fully_shard
from .mesh import ParallelDims
from .pipeline import (
    TiedGradients,
    default_split_points,
    split_stage,
    stage_of,
    stage_units,
    tied_across_stages,
)
from .replicate import replicate_unsharded
from .tensor_parallel import apply_tensor_parallel, check_divisible, resolve_plan


@dataclass
class Parallelized:
    """What :func:`parallelize` made of a model on this rank."""

    dims: ParallelDims
    module: nn.Module
    """The whole model, or this rank's pipeline stage; parameter names as in the original."""
    stage_index: int = 0
    units: list[list[str]] = field(default_factory=list)
    """Units of each pipeline stage (empty without pipeline parallelism)."""
    tied: TiedGradients | None = None
    fully_sharded: bool = False
    """True when FSDP2 wraps the module (then bf16 runs through its MixedPrecisionPolicy)."""

    @property
    def stages(self) -> int:
        return self.dims.pp

    @property
    def is_first_stage(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.dims.pp - 1


def check_model(model: nn.Module, config: TrainConfig, dims: ParallelDims, tp_plan: Mapping | None) -> None:
    """Checks that need the model, before anything is changed (numbers in the messages)."""
    if dims.tp > 1:
        if not tp_plan:
            raise ConfigError(f"tp({dims.tp}) > 1 needs a tensor-parallel plan: pass tp_plan to accelerate()")
        check_divisible(model, resolve_plan(model, tp_plan), dims.tp)
    wanted = config.parallel.activation_checkpointing
    if wanted:
        present = {type(m).__name__ for m in model.modules()}
        missing = [name for name in wanted if name not in present]
        if missing:
            raise ConfigError(
                f"activation_checkpointing: no module of type {', '.join(missing)} in the model; "
                f"types present: {', '.join(sorted(present))}"
            )


def parallelize(
    model: nn.Module,
    config: TrainConfig,
    dims: ParallelDims,
    *,
    device: torch.device,
    tp_plan: Mapping[str, object] | None = None,
    pp_split_points: list[str] | None = None,
    dp_mesh: DeviceMesh | None = None,
) -> Parallelized:
    """Apply pipeline split -> device -> TP -> activation checkpointing -> FSDP2, in that order.

    ``model`` itself is changed in place when pp is 1 (TP and FSDP2 replace
    its parameters); with pp > 1 it is left as it was and a stage copy returned.
    ``dp_mesh``: the mesh FSDP2 shards over (default ``dims.dp_mesh``: HSDP when both
    data-parallel degrees are > 1); ``dims.mesh["dp_shard"]`` leaves the replicas apart.
    """
    check_model(model, config, dims, tp_plan)
    out = Parallelized(dims=dims, module=model)
    if dims.pp > 1:
        points = list(pp_split_points) if pp_split_points else default_split_points(model, dims.pp)
        out.units = stage_units(model, points, dims.pp)
        out.stage_index = dims.pp_rank
        tied = tied_across_stages(model, out.units)
        out.module = split_stage(model, out.units[out.stage_index])
        if tied:
            holders = [[stage_of(name, out.units) for name in names] for names in tied]
            out.tied = TiedGradients(out.module, tied, holders, dims.mesh)
    out.module.to(device)
    if dims.tp > 1:
        apply_tensor_parallel(out.module, dims.tp_mesh, tp_plan or {})
        replicate_unsharded(out.module, dims.tp_mesh)
    present = {type(m).__name__ for m in out.module.modules()}
    here = tuple(t for t in config.parallel.activation_checkpointing if t in present)  # a stage may hold none
    if here:
        apply_activation_checkpointing(out.module, here)
    if dims.dp_size > 1:
        apply_fully_shard(
            out.module, dims.dp_mesh if dp_mesh is None else dp_mesh, precision=config.numerics.precision,
            zero_stage=config.parallel.zero_stage,
            in_pipeline=dims.pp > 1,
        )
        out.fully_sharded = True
    return out
