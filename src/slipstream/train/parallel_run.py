"""``accelerate()`` for layouts beyond plain data parallelism (dp_shard, tp, pp).

The model goes through :func:`slipstream.parallel.parallelize` (pipeline split
-> device -> TP -> activation checkpointing -> FSDP2), the optimizer is built
over the resulting parameters, and :class:`ParallelAccelerated` runs the step:

* without pipeline parallelism, ``run.model(x)`` / ``run.backward(loss)`` /
  ``run.step()`` work as on the DDP path (accumulation: FSDP2's gradient
  reduction runs on the last micro-step only);
* with pipeline parallelism forward and backward are one schedule, so the loop
  is ``loss = run.train_step(x, y, loss_fn)`` (which works for every layout).
  ``x`` is needed on the first stage and ``y`` on the last; every rank passes
  both (ranks of one pipeline feed the same batch: index the data by
  ``run.dp_rank``). The loss (mean over micro-batches) is computed on the last
  stage and broadcast to the pipeline's other stages, so every rank returns it.

Precision: bf16 runs through FSDP2's MixedPrecisionPolicy when the model is
fully sharded, else through autocast; fp16 (which needs a gradient scaler
aware of sharded gradients) is refused on these layouts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import TrainConfig
from ..errors import ConfigError, SlipstreamError
from ..fault import progress
from ..fault.progress import ProgressReporter
from ..metrics import StepRecorder
from ..runtime import Runtime
from .accelerator import (
    Accelerated,
    _build_optimizer,
    _build_scheduler,
    _MicroSteps,
    _new_recorder,
)
from .precision import autocast, outputs_to_fp32


class ParallelModel(nn.Module):
    """``run.model`` on parallel layouts: autocast when FSDP2 does not cast, sample
    counting, and FSDP2's gradient sync armed on the last micro-step only.

    Its state_dict would carry a ``module.`` prefix; checkpoints and
    ``run.unwrapped_state_dict()`` use the inner module, whose names are the original model's.
    """

    def __init__(self, module: nn.Module, *, autocast_precision: str, pipeline: bool) -> None:
        super().__init__()
        self.module = module
        self._sl_autocast = autocast_precision
        self._sl_pipeline = pipeline

    def _slipstream_setup(self, micro: _MicroSteps, device: torch.device, recorder: StepRecorder) -> None:
        self._sl_micro = micro
        self._sl_device = device
        self._sl_recorder = recorder
        self._sl_progress: ProgressReporter | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sl_pipeline:
            raise SlipstreamError(
                "with pp > 1 forward and backward run together in the pipeline schedule: "
                "use loss = run.train_step(x, y, loss_fn) instead of run.model / run.backward / run.step"
            )
        if self._sl_progress is not None:
            self._sl_progress.mark(progress.FORWARD)
        if hasattr(self.module, "set_requires_gradient_sync"):
            self.module.set_requires_gradient_sync(self._sl_micro.syncs)
        _count(self._sl_recorder, args, kwargs)
        timing = self._sl_recorder.begin("forward")
        with autocast(self._sl_autocast, self._sl_device):
            out = self.module(*args, **kwargs)
        self._sl_recorder.end("forward", timing)
        return outputs_to_fp32(out)


def _count(recorder: StepRecorder, args: tuple, kwargs: dict) -> None:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, torch.Tensor) and first.dim() >= 1:
        recorder.add_samples(first.shape[0])
        if first.dim() >= 2 and not first.is_floating_point():
            recorder.add_tokens(first.numel())


class ParallelAccelerated(Accelerated):
    """:class:`Accelerated` over a parallel layout (see the module docstring)."""

    def __init__(self, model: ParallelModel, layout: Any, optimizer, config, runtime, recorder, scheduler=None):
        super().__init__(model, layout.module, optimizer, config, runtime, recorder, scheduler=scheduler)
        self.layout = layout
        self.dims = layout.dims
        self._schedule = None
        self._loss_fn: Callable | None = None
        self._selectors: dict[str, torch.Tensor] | None = None  # see _global_grad_norm
        if self.dims.pp > 1:
            from ..parallel.pipeline import build_schedule

            microbatches = config.pp_microbatches or self.dims.pp
            self._pp_group = self.dims.mesh.get_group("pp")
            self._last_stage_rank = int(self.dims.mesh.mesh[(-1, *self._coords())])
            self._stage, self._schedule = build_schedule(
                layout.module, layout.stage_index, self.dims.pp, runtime.device, self._pp_group,
                config.pp_schedule, microbatches, self._pipeline_loss,
            )
            self._microbatches = microbatches

    def _coords(self) -> tuple[int, ...]:
        mesh = self.dims.mesh
        return tuple(mesh.get_local_rank(d) for d in ("dp_replicate", "dp_shard", "tp"))

    def _model_optimizer_state(self):
        from ..checkpoint.states import ModelOptimizerState

        tied = self.layout.tied
        # The model or stage itself (not the front wrapper): original parameter names.
        return ModelOptimizerState(self.module, self.optimizer, tied.optimizer_names if tied is not None else None)

    def describe_layout(self) -> str:
        return self.dims.describe()

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank

    @property
    def dp_size(self) -> int:
        return self.dims.dp_size

    def _pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(outputs_to_fp32(output), target)

    def backward(self, loss: torch.Tensor) -> None:
        if self._schedule is not None:
            self.model()  # raises the explanation
        super().backward(loss)

    def train_step(self, inputs: Any, target: Any, loss_fn: Callable) -> torch.Tensor:
        if self._schedule is None:
            return super().train_step(inputs, target, loss_fn)
        batch = inputs.shape[0]
        if batch % self._microbatches:
            raise ConfigError(
                f"pp_microbatches({self._microbatches}) does not divide the batch({batch}) of this rank"
            )
        self._loss_fn = loss_fn
        self._mark(progress.BACKWARD)
        _count(self.recorder, (inputs,), {})
        losses: list[torch.Tensor] = []
        layout = self.layout
        # The schedule interleaves forwards and backwards: timed as one "backward" phase.
        timing = self.recorder.begin("backward")
        try:
            with autocast(self.model._sl_autocast, self.device):
                if layout.is_first_stage:
                    self._schedule.step(inputs)
                elif layout.is_last_stage:
                    self._schedule.step(target=target, losses=losses)
                else:
                    self._schedule.step()
        except Exception as exc:  # noqa: BLE001
            self._raise_diagnosed(exc)
        self.recorder.end("backward", timing)
        if layout.is_last_stage:
            loss = torch.stack([l.detach().float() for l in losses]).mean()
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self._last_stage_rank, group=self._pp_group)
        self.recorder.add_loss(loss)
        if layout.tied is not None:
            layout.tied.sum_()
        self.step()
        return loss

    def _global_grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient, over every shard, TP slice and pipeline
        stage (a weight tied across stages counted once). A collective on the mesh: one
        all-reduce of a few floats per mesh dimension the gradients are sharded over, plus
        one over the pipeline, whatever the number of parameters. No host sync."""
        skip = set()
        if self.layout.tied is not None and not self.layout.is_first_stage:
            skip = {id(p) for p, _ in self.layout.tied.params}
        counted = [p.grad for p in self.module.parameters() if p.grad is not None and id(p) not in skip]
        if self._selectors is None:
            # Which mesh dims to sum over, and (as 0/1 device vectors, made once: no
            # host-to-device copy per step) which entries of the sums each one covers.
            # Structural (from the parameters' placements, fixed once parallelized), so
            # every rank of a dimension's group makes the same calls.
            sharded = _sharded_dims(self.module.parameters(), _GRAD_DIMS)
            self._selectors = {
                name: torch.tensor([float(bool(m & (1 << i))) for m in range(1 << len(_GRAD_DIMS))],
                                   device=self.device)
                for i, name in enumerate(_GRAD_DIMS)
                if name in sharded and getattr(self.dims, name) > 1
            }
        square = _local_square_sums(counted, _GRAD_DIMS, self.device)
        for name, sel in self._selectors.items():
            part = square * sel  # the patterns sharded over this dim; the others must not be summed over it
            dist.all_reduce(part, group=self.dims.mesh.get_group(name))
            square = square * (1 - sel) + part
        total = square.sum()
        if self.dims.pp > 1:
            dist.all_reduce(total, group=self._pp_group)
        return total.sqrt()

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip by the global 2-norm (:meth:`_global_grad_norm`); returns the norm before clipping."""
        total = self._global_grad_norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in (p.grad for p in self.module.parameters() if p.grad is not None):
            local = g.to_local() if hasattr(g, "to_local") else g
            groups.setdefault((local.device, local.dtype), []).append(local)
        for (device, _), local in groups.items():
            torch._foreach_mul_(local, coef.to(device))
        return total

    def _grad_norm_due(self) -> bool:
        # The recorder's own optimizer hook would see only local shards here, so the
        # global norm is computed on log steps (same step on every rank: a collective).
        return (self.recorder.step + 1) % self.recorder.log_every_steps == 0

    def unwrapped_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state_dict, full tensors, original names. A collective:
        call it on every rank (each gets the whole dict)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True))
        state = {k: v.detach().cpu() for k, v in state.items()}
        if self.dims.pp > 1:
            parts: list[Any] = [None] * self.dims.pp
            dist.all_gather_object(parts, state, group=self._pp_group)
            state = {k: v for part in parts for k, v in part.items()}
        return state


# Mesh dimensions a gradient may be sharded over (pipeline stages are summed apart).
_GRAD_DIMS = ("dp_replicate", "dp_shard", "tp")


def _placement_mask(grad: Any, dims: tuple[str, ...]) -> int | None:
    """Bit i set when ``grad`` (a DTensor) is sharded over ``dims[i]``; 0 for a plain tensor.
    None when its squares cannot be summed locally: a Partial placement (the local
    values are addends of the gradient, not pieces of it) or a mesh dimension outside ``dims``."""
    placements = getattr(grad, "placements", None)
    if placements is None:
        return 0
    names = grad.device_mesh.mesh_dim_names or ()
    mask = 0
    for i, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if placement.is_partial():
            return None
        # Any other placement holds a distinct piece per rank: Shard, and also FSDP2's
        # _StridedShard under TP, which torch 2.13 does not count as is_shard().
        if i >= len(names) or names[i] not in dims:
            return None
        mask |= 1 << dims.index(names[i])
    return mask


def _sharded_dims(params: Any, dims: tuple[str, ...]) -> set[str]:
    """The dimensions of ``dims`` any parameter is sharded over (from placements, not values)."""
    out: set[str] = set()
    for p in params:
        mask = _placement_mask(p, dims)
        out.update(d for i, d in enumerate(dims) if mask and mask & (1 << i))
    return out


def _local_square_sums(grads: list[Any], dims: tuple[str, ...], device: torch.device) -> torch.Tensor:
    """Pure: fp32 sums of squares of this rank's gradient pieces, one entry per sharding
    pattern: entry ``m`` holds the gradients sharded exactly over the dims whose bit is set
    in ``m``, so that summing entry ``m`` over those dims' groups (and no others) counts every
    element once. Gradients that cannot be summed locally (see :func:`_placement_mask`) are
    reduced whole here, one collective each (none of the layouts here produce them).

    Example::

        _local_square_sums([torch.ones(3)], ("dp_shard",), torch.device("cpu"))   # tensor([3., 0.])
    """
    by_mask: dict[int, list[torch.Tensor]] = {}
    whole: list[torch.Tensor] = []
    for g in grads:
        mask = _placement_mask(g, dims)
        if mask is None:
            n = torch.linalg.vector_norm(g)
            whole.append((n.full_tensor() if hasattr(n, "full_tensor") else n).float().square())
        else:
            by_mask.setdefault(mask, []).append(g.to_local() if hasattr(g, "to_local") else g)
    square = torch.zeros(1 << len(dims), device=device, dtype=torch.float32)
    for mask, local in by_mask.items():
        # One fused kernel per pattern; norms in fp32 even for bf16 gradients.
        norms = torch._foreach_norm(local, 2, dtype=torch.float32)
        square[mask] = torch.stack([n.to(device) for n in norms]).square().sum()
    for sq in whole:
        square[0] += sq.to(device)
    return square


def _rebuild_optimizer(
    optimizer: torch.optim.Optimizer, names: dict[int, list[str]], module: nn.Module
) -> torch.optim.Optimizer:
    """The same optimizer class and per-group hyperparameters over ``module``'s new parameters."""
    if any(optimizer.state.values()):
        raise ConfigError(
            "the optimizer has state already (it has stepped): on layouts that shard or split the model pass "
            "a fresh optimizer or a factory, e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)"
        )
    new = dict(module.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        # A tied weight has several names; a pipeline stage may hold it under its second one only.
        params = []
        for p in group["params"]:
            held = [n for n in names.get(id(p), []) if n in new]
            if held and not any(q is new[held[0]] for q in params):
                params.append(new[held[0]])
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if not groups:
        raise ConfigError("the optimizer holds none of this rank's parameters")
    # Constructor arguments from the defaults it accepts (AdamW's defaults hold
    # internal keys such as decoupled_weight_decay that its __init__ does not take).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted and k != "params"}
    return type(optimizer)(groups, **kwargs)


def accelerate_parallel(
    model: nn.Module,
    optimizer: Any,
    config: TrainConfig,
    runtime: Runtime,
    *,
    scheduler: Any = None,
    extra_state: dict[str, Any] | None = None,
    tp_plan: dict[str, Any] | None = None,
    pp_split_points: list[str] | None = None,
) -> ParallelAccelerated:
    """The parallel-layout branch of :func:`slipstream.accelerate` (see the module docstring)."""
    from ..parallel import ParallelDims, parallelize

    if config.precision == "fp16":
        raise ConfigError("precision fp16 is not supported with dp_shard, tp or pp; use bf16")
    if config.sync != "allreduce" or config.sync_options:
        raise ConfigError(
            f"sync {config.sync!r} is a DDP gradient hook; with dp_shard, tp or pp, FSDP2 reduces the "
            "gradients (leave sync at allreduce)"
        )
    dims = ParallelDims.build(config, runtime.world_size, runtime.device.type)
    if dims.pp > 1 and config.accumulate_steps > 1:
        raise ConfigError(
            f"accumulate_steps({config.accumulate_steps}) with pp({dims.pp}): use pp_microbatches instead "
            "(the pipeline already accumulates over its micro-batches)"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        owned = {id(p) for p in model.parameters()}
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in owned)
        if foreign:
            raise ConfigError(f"the optimizer holds {foreign} parameter(s) that are not in the model")
        if scheduler is not None and hasattr(scheduler, "step"):
            raise ConfigError(
                "with dp_shard, tp or pp the optimizer is rebuilt over the sharded parameters, so a scheduler "
                "bound to the old one would not see it: pass scheduler=lambda optimizer: ... (a factory)"
            )
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    layout = parallelize(model, config, dims, device=runtime.device, tp_plan=tp_plan, pp_split_points=pp_split_points)
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer = _rebuild_optimizer(optimizer, names, layout.module)
    else:
        optimizer = _build_optimizer(optimizer, layout.module.parameters())
    scheduler = _build_scheduler(scheduler, optimizer)

    recorder = _new_recorder(config, runtime)
    micro = _MicroSteps(config.accumulate_steps)
    front = ParallelModel(
        layout.module,
        autocast_precision="fp32" if layout.fully_sharded else config.precision,
        pipeline=dims.pp > 1,
    )
    front._slipstream_setup(micro, runtime.device, recorder)
    recorder.attach(layout.module, config, runtime.device, runtime.local_rank, None)
    run = ParallelAccelerated(front, layout, optimizer, config, runtime, recorder, scheduler=scheduler)
    if config.checkpoint_dir is not None:
        run._enable_checkpoints(extra_state or {})
    elif extra_state:
        raise ConfigError("extra_state is saved in checkpoints: set checkpoint_dir too")
    return run
