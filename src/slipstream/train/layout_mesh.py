"""The mesh layout: FSDP2, tensor and pipeline parallelism on a device mesh.

The model goes through :func:`slipstream.parallel.parallelize` (pipeline split
-> device -> TP -> activation checkpointing -> FSDP2), the optimizer is built
over the resulting parameters, and the step runs as on every layout:

* without pipeline parallelism, ``run.model(x)`` / ``run.backward(loss)`` /
  ``run.step()`` work as on the DDP layout (accumulation: FSDP2's gradient
  reduction runs on the last micro-step only);
* with pipeline parallelism forward and backward are one schedule
  (:class:`PipelineRunner`), so the loop is ``loss = run.train_step(x, y, loss_fn)``
  (which works for every layout). ``x`` is needed on the first stage and ``y``
  on the last; every rank passes both (ranks of one pipeline feed the same
  batch: index the data by ``run.dp_rank``). The loss (mean over micro-batches)
  is computed on the last stage and broadcast to the pipeline's other stages,
  so every rank returns it.

Precision: bf16 runs through FSDP2's MixedPrecisionPolicy when the model is
fully sharded, else through autocast; fp16 (which needs a gradient scaler
aware of sharded gradients) and DDP sync strategies are refused by
:class:`~slipstream.config.TrainConfig` on these layouts.

``sync diloco`` with dp_shard (tp and pp refused by the config): each
``dp_shard`` group is one DiLoCo replica. FSDP2 shards over ``dp_shard`` only
(no HSDP all-reduce across replicas at each step), and the strategy
(:func:`slipstream.sync.apply_to_replicas`) runs its outer step over the mesh's
``dp_replicate`` group from the facade's ``after_optimizer_step``. With one
replica (dp_replicate 1) there is nothing to join: plain FSDP2, logged once.

Example::

    layout = MeshLayout(model, config, runtime, context, tp_plan=GPT_TP_PLAN)
    layout.describe()     # "pp(1) x dp_replicate(1) x dp_shard(2) x tp(2)"
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map_only

from .. import sync
from ..checkpoint.states import ModelOptimizerState
from ..config import TrainConfig
from ..errors import ConfigError, SlipstreamError, TrainingFailed
from ..fault import progress
from ..log import CONSOLE
from ..parallel import ParallelDims, Parallelized, build_schedule, parallelize
from ..parallel.fully_shard import release_groups, repoint_groups, reset_after_failure
from ..parallel.host_gather import HostGather
from ..process.runtime import Runtime
from ..sync import SyncHandle
from .layout import LossFn
from .mesh_norm import GRAD_DIMS, local_square_sums, sharded_dims
from .microsteps import ForwardContext, count_inputs
from .optimizer_build import (
    OptimizerArg,
    build_optimizer,
    parameter_names,
    rebuild_optimizer,
    without_unsupported_fused,
)
from .precision import autocast, outputs_to_fp32

log = logging.getLogger(__name__)


class ParallelModel(nn.Module):
    """``run.model`` on mesh layouts: autocast when FSDP2 does not cast, sample
    counting, and FSDP2's gradient sync armed on the last micro-step only.

    Its state_dict would carry a ``module.`` prefix; checkpoints and
    ``run.unwrapped_state_dict()`` use the inner module, whose names are the original model's.
    """

    def __init__(self, module: nn.Module, *, context: ForwardContext, autocast_precision: str, pipeline: bool) -> None:
        super().__init__()
        self.module = module
        self._sl_context = context
        self._sl_autocast = autocast_precision
        self._sl_pipeline = pipeline
        # Set by accelerate() under healing in place: takes an exception of the forward (FSDP2's
        # all-gathers, TP's collectives) and answers True when the group healed; None: raise it.
        self.sl_on_failure: Callable[[BaseException], bool] | None = None
        self._sl_last_output: Any = None  # the last output's shapes (meta tensors): see forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sl_pipeline:
            raise SlipstreamError(
                "with pp > 1 forward and backward run together in the pipeline schedule: "
                "use loss = run.train_step(x, y, loss_fn) instead of run.model / run.backward / run.step"
            )
        ctx = self._sl_context
        if ctx.progress is not None:
            ctx.progress.mark(progress.FORWARD)
        if hasattr(self.module, "set_requires_gradient_sync"):  # FSDP2's method: absent without dp
            self.module.set_requires_gradient_sync(ctx.micro.syncs)
        count_inputs(ctx.recorder, args, kwargs, ctx.micro)
        timing = ctx.recorder.begin("forward")
        with autocast(self._sl_autocast, ctx.device):
            try:
                out = self.module(*args, **kwargs)
                if self.sl_on_failure is not None:
                    _wait_collectives(out)
            except Exception as exc:  # noqa: BLE001 - re-raised unless the run healed in place
                if self.sl_on_failure is None or not self.sl_on_failure(exc):
                    raise
                out = self._dropped_output(exc)
            else:
                if self.sl_on_failure is not None:
                    self._sl_last_output = tree_map_only(torch.Tensor, _meta_like, out)
        ctx.recorder.end("forward", timing)
        return outputs_to_fp32(out)

    def _dropped_output(self, exc: BaseException) -> Any:
        """The output of a micro-step a heal dropped (backward and step skip it; its loss is never
        used). The loop still needs one, but a sharded or tensor-parallel forward cannot run
        without its collectives, which the other ranks are not making (a replacement is already
        in its first real step): zeros shaped as the last forward's output, made here."""
        if self._sl_last_output is None:  # no forward completed in this process since it armed
            raise TrainingFailed("the group healed in place during this process's first forward, which "
                                 "has no output to stand in for the dropped micro-step") from exc
        device = self._sl_context.device
        return tree_map_only(torch.Tensor, lambda m: torch.zeros(m.shape, dtype=m.dtype, device=device),
                             self._sl_last_output)


def _wait_collectives(out: Any) -> None:
    """Wait here for the collectives whose results the output still holds unwaited: a tensor-parallel
    output is DTensor's functional all-reduce, waited for at its first use, which is the user's loss
    function, outside this forward. A lost peer then surfaces inside the forward, where the layout
    heals, and not in the loss, which nothing catches. (No copy: the output stays the same tensor.)"""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor

    for leaf in tree_leaves(out):
        local = leaf._local_tensor if isinstance(leaf, DTensor) else leaf
        if isinstance(local, AsyncCollectiveTensor):
            local.trigger_wait()


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor's shape and dtype, holding no memory (a DTensor: its global shape)."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


class PipelineRunner:
    """One micro-step of pipeline parallelism: the schedule's forwards and backwards
    (timed as one "backward" phase), the loss broadcast, tied gradients summed."""

    def __init__(self, parts: Parallelized, config: TrainConfig, context: ForwardContext, autocast_precision: str):
        dims = parts.dims
        self._parts = parts
        self._context = context
        self._autocast = autocast_precision
        self._microbatches = config.parallel.pp_microbatches or dims.pp
        self._group = dims.mesh.get_group("pp")
        coords = tuple(dims.mesh.get_local_rank(d) for d in ("dp_replicate", "dp_shard", "tp"))
        self._last_stage_rank = int(dims.mesh.mesh[(-1, *coords)])
        self._loss_fn: LossFn | None = None
        _, self._schedule = build_schedule(
            parts.module, parts.stage_index, dims.pp, context.device, self._group,
            config.parallel.pp_schedule, self._microbatches, self._stage_loss,
        )

    @property
    def group(self) -> Any:
        """The process group of this rank's pipeline."""
        return self._group

    def _stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(outputs_to_fp32(output), target)

    def run(self, inputs: torch.Tensor, target: Any, loss_fn: LossFn) -> torch.Tensor:
        batch = inputs.shape[0]
        if batch % self._microbatches:
            raise ConfigError(f"pp_microbatches({self._microbatches}) does not divide the batch({batch}) of this rank")
        ctx, parts = self._context, self._parts
        self._loss_fn = loss_fn
        if ctx.progress is not None:
            ctx.progress.mark(progress.BACKWARD)
        count_inputs(ctx.recorder, (inputs,), {}, ctx.micro)
        losses: list[torch.Tensor] = []
        timing = ctx.recorder.begin("backward")
        with autocast(self._autocast, ctx.device):
            if parts.is_first_stage:
                self._schedule.step(inputs)
            elif parts.is_last_stage:
                self._schedule.step(target=target, losses=losses)
            else:
                self._schedule.step()
        ctx.recorder.end("backward", timing)
        if parts.is_last_stage:
            loss = torch.stack([l.detach().float() for l in losses]).mean()
        else:
            loss = torch.zeros((), device=ctx.device)
        dist.broadcast(loss, src=self._last_stage_rank, group=self._group)
        if parts.tied is not None:
            parts.tied.sum_()
        return loss


class MeshLayout:
    """:class:`~slipstream.train.layout.Layout` on a device mesh (see the module docstring).

    Collective: every rank builds it (the mesh, FSDP2, the pipeline stages).
    """

    sync: SyncHandle | None = None  # FSDP2 reduces the gradients; diloco alone joins dp_shard replicas

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig,
        runtime: Runtime,
        context: ForwardContext,
        *,
        tp_plan: Mapping[str, Any] | None = None,
        pp_split_points: list[str] | None = None,
    ) -> None:
        dims = ParallelDims.build(config, runtime.world_size, runtime.device.type)
        accumulate_steps = config.numerics.accumulate_steps
        if dims.pp > 1 and accumulate_steps > 1:
            raise ConfigError(
                f"accumulate_steps({accumulate_steps}) with pp({dims.pp}): use pp_microbatches instead "
                "(the pipeline already accumulates over its micro-batches)"
            )
        self._names = parameter_names(model)  # before parallelize replaces the parameters
        # FSDP2 inside each replica; the strategy (diloco) joins them over dp_replicate.
        replicas = sync.describe(config.sync.strategy).on_sharded_replicas
        parts = parallelize(model, config, dims, device=runtime.device, tp_plan=tp_plan,
                            pp_split_points=pp_split_points, dp_mesh=dims.mesh["dp_shard"] if replicas else None)
        self._parts = parts
        self.dims = dims
        self.module = parts.module
        self.dp_rank = dims.dp_rank
        self.dp_size = dims.dp_size
        self._device = runtime.device
        autocast_precision = "fp32" if parts.fully_sharded else config.numerics.precision
        self.model = ParallelModel(parts.module, context=context, autocast_precision=autocast_precision,
                                   pipeline=dims.pp > 1)
        self.pipeline = PipelineRunner(parts, config, context, autocast_precision) if dims.pp > 1 else None
        self._selectors: dict[str, torch.Tensor] | None = None  # see global_grad_norm
        self._gather: HostGather | None = None  # see unwrapped_state_dict
        self._optimizer: torch.optim.Optimizer | None = None  # see rejoined
        if replicas:
            self.sync = self._join_replicas(config)

    def _join_replicas(self, config: TrainConfig) -> SyncHandle | None:
        """The strategy (``diloco``) over the dp_shard replicas (a collective over dp_replicate), or None with one."""
        dims = self.dims
        if dims.dp_replicate == 1:
            if dist.get_rank() == 0:
                log.info("sync %s with dp_replicate(1): one replica, nothing to join: plain FSDP2 over "
                         "dp_shard(%d), no outer step", config.sync.strategy, dims.dp_shard, extra=CONSOLE)
            return None
        return sync.apply_to_replicas(config.sync.strategy, self.module, dims.mesh.get_group("dp_replicate"),
                                      **config.sync.options)

    # --- healing in place (slipstream.resilience.heal; the Layout protocol's healing interface) ------------
    def heal_refusal(self) -> str | None:
        """Why this layout cannot heal in place (None: it can): pipeline parallelism (its schedule
        and stages keep point-to-point groups of their own, not formed again yet), and ``diloco``
        over dp_shard replicas (its outer step holds the dp_replicate group)."""
        if self.dims.pp > 1:
            return (f"pipeline parallelism (pp {self.dims.pp}) keeps the schedule's own point-to-point "
                    "groups, which are not formed again in place")
        if self.sync is not None:
            return "diloco's outer step over the dp_shard replicas keeps the dp_replicate group"
        return None

    def release(self) -> None:
        """Before the broken default group is destroyed: every reference to the mesh's groups dropped
        (FSDP2's, the mesh's cache, the host gather's side groups) and the mesh's own groups
        destroyed first, so their sockets close and a peer blocked on one of them fails and heals
        too (why first: ParallelDims.release_groups)."""
        release_groups(self.module)
        self.dims.release_groups()
        self._gather = None

    def leave(self) -> None:
        """After the broken groups were destroyed: FSDP2 back to a step that never began (the failed
        collectives' results dropped, every parameter sharded, no gradient)."""
        reset_after_failure(self.module)

    def rejoined(self) -> None:
        """After the default group was formed again: the mesh's groups made again under their names,
        and FSDP2's group objects looked up again (see ParallelDims.reform_groups). Collective."""
        self.dims.reform_groups()
        repoint_groups(self.module)
        if self._optimizer is not None and not self._optimizer.state:
            # A replacement's optimizer has no state yet, and the in-memory snapshot rebuilds each
            # saved shard as a DTensor only where the current state holds one (else a plain tensor,
            # which foreach and fused steps refuse beside DTensor parameters): made first, by the
            # step with zero gradients and lr 0 that torch's own checkpoint load takes (the restore
            # that follows overwrites every value).
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(self._optimizer)

    def describe(self) -> str:
        return self.dims.describe()

    def optimizer_for(self, optimizer: OptimizerArg) -> torch.optim.Optimizer:
        if isinstance(optimizer, torch.optim.Optimizer):
            built = rebuild_optimizer(optimizer, self._names, self.module)
        else:
            built = build_optimizer(optimizer, self.module.parameters())
        built, note = without_unsupported_fused(built, self.describe())
        if note and dist.get_rank() == 0:
            log.warning(note, extra=CONSOLE)
        self._optimizer = built
        return built

    def global_grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient, over every shard, TP slice and pipeline
        stage (a weight tied across stages counted once). A collective on the mesh: one
        all-reduce of a few floats per mesh dimension the gradients are sharded over, plus
        one over the pipeline, whatever the number of parameters. No host sync."""
        parts = self._parts
        skip = set()
        if parts.tied is not None and not parts.is_first_stage:
            skip = {id(p) for p, _ in parts.tied.params}
        counted = [p.grad for p in self.module.parameters() if p.grad is not None and id(p) not in skip]
        if self._selectors is None:
            # Which mesh dims to sum over, and (as 0/1 device vectors, made once: no
            # host-to-device copy per step) which entries of the sums each one covers.
            # Structural (from the parameters' placements, fixed once parallelized), so
            # every rank of a dimension's group makes the same calls.
            sharded = sharded_dims(self.module.parameters(), GRAD_DIMS)
            self._selectors = {
                name: torch.tensor([float(bool(m & (1 << i))) for m in range(1 << len(GRAD_DIMS))],
                                   device=self._device)
                for i, name in enumerate(GRAD_DIMS)
                if name in sharded and getattr(self.dims, name) > 1
            }
        square = local_square_sums(counted, GRAD_DIMS, self._device)
        for name, sel in self._selectors.items():
            part = square * sel  # the patterns sharded over this dim; the others must not be summed over it
            dist.all_reduce(part, group=self.dims.mesh.get_group(name))
            square = square * (1 - sel) + part
        total = square.sum()
        if self.pipeline is not None:
            dist.all_reduce(total, group=self.pipeline.group)
        return total.sqrt()

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Clip by the global 2-norm (:meth:`global_grad_norm`); returns the norm before clipping."""
        total = self.global_grad_norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in (p.grad for p in self.module.parameters() if p.grad is not None):
            local = g.to_local() if hasattr(g, "to_local") else g  # a DTensor's shard, or the tensor
            groups.setdefault((local.device, local.dtype), []).append(local)
        for (device, _), local in groups.items():
            torch._foreach_mul_(local, coef.to(device))
        return total

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> ModelOptimizerState:
        tied = self._parts.tied
        # The model or stage itself (not the front wrapper): original parameter names.
        return ModelOptimizerState(self.module, optimizer, tied.optimizer_names if tied is not None else None)

    def unwrapped_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state_dict, full tensors, original names. A collective:
        call it on every rank (each gets the whole dict)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        # The sharded dict (no communication), then each tensor whole through
        # HostGather: under gloo on the host (its functional all-gather crashes on
        # device tensors), under NCCL on the device.
        if self._gather is None:
            self._gather = HostGather(self.dims.mesh)
        self._gather.prepare()
        state = {k: self._gather.full(v) for k, v in get_model_state_dict(self.module).items()}
        if self.pipeline is not None:
            parts: list[Any] = [None] * self.dims.pp
            dist.all_gather_object(parts, state, group=self.pipeline.group)
            state = {k: v for part in parts for k, v in part.items()}
        return state
