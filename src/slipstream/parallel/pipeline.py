"""Pipeline parallelism on ``torch.distributed.pipelining``: stage split, schedule, tied weights.

How a model is split (torchtitan's way): every stage starts from a deep copy
of the whole model and deletes the modules that belong to other stages, so
the modules it keeps have their original names (``blocks.3.mlp.fc.weight``
stays ``blocks.3.mlp.fc.weight``) and a checkpoint saved by one layout loads
in another. The model's contract, for it to be split:

* its top-level children are registered in the order the forward uses them;
* repeated layers live in an ``nn.ModuleDict`` (deleting from an
  ``nn.ModuleList`` would renumber the rest);
* ``forward`` skips a top-level child that is ``None`` and, where the first
  module is gone, takes the previous stage's output as its input.

Split points name the units where a new stage begins: a unit is a top-level
child, or an entry of a top-level ``ModuleDict``. ``["blocks.2"]`` on a GPT of
four blocks: stage 0 = tok, pos, blocks.0, blocks.1; stage 1 = blocks.2,
blocks.3, ln, head. Without split points the entries of the largest
``ModuleDict`` are spread evenly.

Tied weights (a GPT's ``head.weight is tok.weight``): when the tied names end
up on different stages each stage holds its own copy; the copies start equal
and stay equal because :class:`TiedGradients` sums their gradients between the
stages that hold them before every optimizer step (Megatron-LM's approach),
which is exactly the gradient of the tied parameter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ConfigError
from ..process.runtime import group_timeout


def pipeline_units(model: nn.Module) -> list[str]:
    """Names of the units a pipeline split can cut between, in order."""
    units = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleDict):
            units += [f"{name}.{key}" for key in child]
        elif isinstance(child, nn.ModuleList) and len(child) > 1:
            raise ConfigError(
                f"pipeline split: {name} is an nn.ModuleList; use an nn.ModuleDict so that stages keep layer names"
            )
        else:
            units.append(name)
    return units


def default_split_points(model: nn.Module, stages: int) -> list[str]:
    """Spread the entries of the largest top-level ModuleDict evenly over ``stages``."""
    dicts = [(name, child) for name, child in model.named_children() if isinstance(child, nn.ModuleDict)]
    if not dicts:
        raise ConfigError("pp > 1 needs pp_split_points (no nn.ModuleDict of layers to split evenly)")
    name, layers = max(dicts, key=lambda item: len(item[1]))
    keys = list(layers.keys())
    if len(keys) < stages:
        raise ConfigError(f"pp({stages}) is more than the {len(keys)} layers of {name}")
    return [f"{name}.{keys[(len(keys) * s) // stages]}" for s in range(1, stages)]


def stage_units(model: nn.Module, split_points: list[str], stages: int) -> list[list[str]]:
    """The units of each stage."""
    units = pipeline_units(model)
    if len(split_points) != stages - 1:
        raise ConfigError(f"pp({stages}) needs {stages - 1} split point(s), got {len(split_points)}: {split_points}")
    unknown = [p for p in split_points if p not in units]
    if unknown:
        raise ConfigError(f"pipeline split point(s) {unknown} are not units of the model; units: {units}")
    cuts = [units.index(p) for p in split_points]
    if cuts != sorted(set(cuts)) or (cuts and cuts[0] == 0):
        raise ConfigError(f"pipeline split points must be in model order and leave no stage empty, got {split_points}")
    bounds = [0, *cuts, len(units)]
    return [units[bounds[s] : bounds[s + 1]] for s in range(stages)]


def split_stage(model: nn.Module, keep: list[str]) -> nn.Module:
    """A deep copy of ``model`` with every unit not in ``keep`` deleted (names kept)."""
    stage = copy.deepcopy(model)
    for unit in pipeline_units(model):
        if unit in keep:
            continue
        parent_name, _, key = unit.rpartition(".")
        if parent_name:
            del stage.get_submodule(parent_name)[key]
        else:
            setattr(stage, key, None)
    return stage


def _param_names(model: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def stage_of(param_name: str, units_per_stage: list[list[str]]) -> int:
    """The stage whose units hold ``param_name``."""
    for s, units in enumerate(units_per_stage):
        if any(param_name == u or param_name.startswith(u + ".") for u in units):
            return s
    raise ConfigError(f"parameter {param_name} belongs to no pipeline unit")


def tied_across_stages(model: nn.Module, units_per_stage: list[list[str]]) -> list[tuple[str, ...]]:
    """Groups of parameter names that share one tensor and fall on different stages."""
    groups = []
    for names in _param_names(model).values():
        if len(names) > 1 and len({stage_of(n, units_per_stage) for n in names}) > 1:
            groups.append(tuple(names))
    return groups


def canonical_names(stage: nn.Module, groups: list[tuple[str, ...]]) -> dict[str, str]:
    """Stage name -> whole-model name of tied weights this stage holds under another name.

    The state-dict API keys a tied parameter's optimizer state by its first
    name in ``named_parameters()`` (``tok.weight``); a stage that holds it only
    as ``head.weight`` renames, so checkpoints match across layouts.
    """
    own = [name for name, _ in stage.named_parameters()]
    out = {}
    for names in groups:
        held = [n for n in names if n in own]
        if held and held[0] != names[0]:
            out[held[0]] = names[0]
    return out


class TiedGradients:
    """Sums the gradients of tied weights between the stages that hold a copy.

    One process group per tied pair of stages and per (dp, tp) coordinate,
    built from the mesh's rank layout; every rank creates every group (as
    ``new_group`` requires) and keeps its own.
    """

    def __init__(self, stage: nn.Module, groups: list[tuple[str, ...]], holder_stages: list[list[int]], mesh) -> None:
        self.stage = stage
        self.names: list[tuple[str, object]] = []  # (this stage's name of the weight, its group)
        self.optimizer_names = canonical_names(stage, groups)
        ranks = mesh.mesh  # (pp, dp_replicate, dp_shard, tp) tensor of global ranks
        me = dist.get_rank()
        own = dict(stage.named_parameters(remove_duplicate=False))
        for names, stages in zip(groups, holder_stages):
            holders = sorted(set(stages))
            mine = None
            flat = ranks.reshape(ranks.shape[0], -1)
            for column in range(flat.shape[1]):
                members = [int(flat[s, column]) for s in holders]
                group = dist.new_group(members, timeout=group_timeout())
                if me in members:
                    mine = group
            held = [n for n in names if n in own]
            if held and mine is not None:
                self.names.append((held[0], mine))

    @property
    def params(self) -> list[tuple[nn.Parameter, object]]:
        """Looked up by name each time: TP and FSDP2 replace the parameter objects."""
        own = dict(self.stage.named_parameters(remove_duplicate=False))
        return [(own[name], group) for name, group in self.names]

    def sum_(self) -> None:
        """Add the other stages' gradients of each tied weight into this stage's."""
        for param, group in self.params:
            if param.grad is None:
                continue
            grad = param.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            dist.all_reduce(local, group=group)


def check_p2p_device(device: torch.device, group) -> None:
    """Refuse stage-to-stage sends that the backend cannot carry.

    gloo's send/recv hand the tensor's raw pointer to a host transport: with
    CUDA tensors (gloo on GPUs, shared on purpose) that reads device memory from
    the host and crashes the process. Its collectives stage CUDA tensors
    through the host; its point-to-point calls do not.

    Example::

        check_p2p_device(torch.device("cpu"), None)   # gloo on the CPU: fine
    """
    if device.type == "cuda" and dist.is_initialized() and str(dist.get_backend(group)) == "gloo":
        raise ConfigError(
            "pp > 1 with backend gloo and CUDA tensors: gloo's send/recv cannot carry GPU memory; "
            "use backend nccl (one GPU per rank), or device cpu for a pipeline over gloo"
        )


def build_schedule(
    stage_module: nn.Module,
    stage_index: int,
    stages: int,
    device: torch.device,
    pp_group,
    schedule: str,
    microbatches: int,
    loss_fn: Callable | None,
):
    """A ``PipelineStage`` around ``stage_module`` and its GPipe or 1F1B schedule.

    Gradients are divided by the number of micro-batches (``scale_grads``), so
    a mean loss per micro-batch gives the same gradient as the mean over the
    whole batch.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    check_p2p_device(device, pp_group)
    stage = PipelineStage(stage_module, stage_index, stages, device, group=pp_group)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return stage, kind(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)
