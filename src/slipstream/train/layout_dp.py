"""The data-parallel layout: DDP over every rank, with Slipstream's gradient-sync strategy.

What it does to the model, in this order: activation checkpointing of the
chosen module types -> move to the device -> DDP (fused buckets overlapping
backward, gradients as bucket views) -> the gradient-sync strategy
(:func:`slipstream.sync.apply`). Every rank holds the whole model and, after
the synchronising backward, the whole (averaged) gradient: norms and clipping
are local, with no collective.

Example::

    layout = DataParallelLayout(model, config, runtime, context)
    run_model = layout.model          # SlipstreamDDP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import sync
from ..checkpoint.states import ModelOptimizerState
from ..config import TrainConfig
from ..errors import ConfigError
from ..fault import progress
from ..parallel.activation_checkpointing import apply_activation_checkpointing
from ..process.runtime import Runtime
from ..resilience import heal
from .bucket_order import fix_bucket_order, fix_bucket_order_again
from .layout import Pipeline
from .microsteps import ForwardContext, count_inputs
from .optimizer_build import OptimizerArg, build_optimizer
from .precision import autocast, outputs_to_fp32


class SlipstreamDDP(DistributedDataParallel):
    """DDP whose forward runs under autocast, counts samples, and arms or
    disarms gradient synchronisation for the coming backward.

    ``ddp_options`` go to :class:`~torch.nn.parallel.DistributedDataParallel`.
    """

    def __init__(self, module: nn.Module, *, context: ForwardContext, precision: str, **ddp_options: Any) -> None:
        super().__init__(module, **ddp_options)
        self._sl_context = context
        self._sl_precision = precision
        # One rank has nothing to reduce, yet DDP's reducer would still copy every gradient into
        # its bucket (a kernel per parameter tensor: 101 on the 167M decoder of the H200 run),
        # all-reduce each bucket with itself and broadcast the buffers at every forward. The
        # sum of one rank's gradient is that gradient, bit for bit, so a single rank keeps its
        # backwards local (DDP's no_sync path) and trains exactly as a plain loop does.
        # static_graph's first backward reduces from a callback DDP queues whatever the flag
        # says: it keeps DDP's own path.
        self._sl_reduces = dist.get_world_size(self.process_group) > 1 or self.static_graph
        # Set by accelerate() under healing in place: takes an exception of the forward (DDP
        # broadcasts buffers there) and answers True when the group healed; None: raise it.
        self.sl_on_failure: Callable[[BaseException], bool] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self._sl_context
        if ctx.progress is not None:
            ctx.progress.mark(progress.FORWARD)
        # DDP reads this flag in forward to decide whether the next backward
        # reduces gradients (the same mechanism as its no_sync() context).
        self.require_backward_grad_sync = self._sl_reduces and ctx.micro.syncs
        count_inputs(ctx.recorder, args, kwargs, ctx.micro)
        timing = ctx.recorder.begin("forward")
        with autocast(self._sl_precision, ctx.device):
            try:
                out = super().forward(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised unless the run healed in place
                if self.sl_on_failure is None or not self.sl_on_failure(exc):
                    raise
                # Healed: this micro-step is dropped (backward and step do nothing for it), but the
                # loop still needs an output: the local forward, no collective and no graph.
                with torch.no_grad():
                    out = self.module(*args, **kwargs)
        ctx.recorder.end("forward", timing)
        return outputs_to_fp32(out)


class DataParallelLayout:
    """:class:`~slipstream.train.layout.Layout` of plain data parallelism (see the module docstring).

    Collective: every rank builds it (DDP broadcasts the parameters of rank 0;
    some sync strategies probe the link).
    """

    pipeline: Pipeline | None = None

    def __init__(self, model: nn.Module, config: TrainConfig, runtime: Runtime, context: ForwardContext) -> None:
        self.module = model
        self._world_size = runtime.world_size
        self.dp_rank = runtime.rank
        self.dp_size = runtime.world_size
        # Norms and clipping: torch takes the foreach kernels on CUDA by itself, but on the CPU it
        # loops over the tensors in Python (101 norms on the 167M decoder's 101 tensors). The
        # foreach path gives the same bits there (checked in fp32 and bf16), in one call.
        self._foreach: bool | None = True if runtime.device.type == "cpu" else None
        apply_activation_checkpointing(model, config.parallel.activation_checkpointing)
        model.to(runtime.device)
        self.model = SlipstreamDDP(
            model,
            context=context,
            precision=config.numerics.precision,
            device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
            bucket_cap_mb=config.sync.bucket_cap_mb,
            gradient_as_bucket_view=config.sync.gradient_as_bucket_view,
            find_unused_parameters=config.sync.find_unused_parameters,
            static_graph=config.sync.static_graph,
        )
        # Before the strategy's comm hook: the same bucket layout at every step of
        # every run, so a resumed run sums gradients in the order the run did.
        # diloco sums no gradient (its hook hands each bucket back): the layout changes
        # nothing, and fixing it would send the model's size over a link chosen for being slow
        # (its description says so: sync.describe(name).fixes_bucket_order).
        strategy = config.sync.strategy
        self._fixes_order = sync.describe(strategy).fixes_bucket_order
        if self._fixes_order and not heal.on_fake_group():  # a replacement: in rejoined()
            fix_bucket_order(self.model)
        try:
            self.sync: sync.SyncHandle | None = sync.apply(strategy, self.model, **config.sync.options)
        except (TypeError, ValueError) as exc:  # an option the strategy does not take, or a bad value
            raise ConfigError(f"sync_options for {strategy!r}: {exc}") from None

    def heal_refusal(self) -> str | None:
        """None: DDP heals in place (whether the sync strategy does is the facade's question)."""
        return None

    def release(self) -> None:
        """Nothing: DDP holds the default group alone, which the healer destroys (then :meth:`leave`)."""

    def leave(self) -> None:
        """After the broken group was destroyed (healing in place, :meth:`slipstream.resilience.heal.Healer.leave`):
        DDP lets go of it for the fake default group, so its sockets close and no peer waits on them."""
        self.model._update_process_group(dist.group.WORLD)
        if self.sync is not None:
            self.sync.leave()  # the strategy's own groups (sync.SyncHandle.leave)

    def rejoined(self) -> None:
        """After the default group was formed again (healing in place, :mod:`slipstream.resilience.heal`):
        DDP moves onto the new group and rebuilds its buckets in the run's order. Collective."""
        self.model._update_process_group(dist.group.WORLD)  # DDP's own hook for this; the comm hook stays
        if self.sync is not None:
            self.sync.rejoined()  # its groups formed again, before the bucket-order fix's backward
        if self._fixes_order:
            fix_bucket_order_again(self.model)

    def describe(self) -> str:
        return f"pp(1) x dp_replicate({self._world_size}) x dp_shard(1) x tp(1)"

    def optimizer_for(self, optimizer: OptimizerArg) -> torch.optim.Optimizer:
        # DDP keeps the model's parameters: a given optimizer already holds them.
        return build_optimizer(optimizer, self.module.parameters())

    def global_grad_norm(self) -> torch.Tensor:
        return torch.nn.utils.get_total_norm([p.grad for p in self.module.parameters() if p.grad is not None],
                                             foreach=self._foreach)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm, foreach=self._foreach)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> ModelOptimizerState:
        return ModelOptimizerState(self.model, optimizer)  # DDP: the state-dict API strips ``module.``

    def unwrapped_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()
