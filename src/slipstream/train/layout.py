"""The layout seam: how the model is spread over the ranks, as one strategy object.

:class:`slipstream.train.Accelerated` runs the same step for every layout
(micro-steps, precision, clipping, checkpoints, metrics, preemption) and asks
its :class:`Layout` for the parts that depend on where the parameters live.
Two implementations:

* :class:`~slipstream.train.layout_dp.DataParallelLayout`: DDP over every rank
  with Slipstream's gradient-sync strategies (the default);
* :class:`~slipstream.train.layout_mesh.MeshLayout`: FSDP2 / tensor / pipeline
  parallelism on a device mesh (:mod:`slipstream.parallel`).

A layout is built complete (its constructor wraps the model) and changes the
model once; the facade never reaches into it except through this protocol.

Example::

    layout = DataParallelLayout(model, config, runtime, context)
    optimizer = layout.optimizer_for(lambda params: torch.optim.SGD(params, lr=0.1))
    layout.clip_gradients(1.0)      # after backward: the global norm before clipping
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ..checkpoint.states import ModelOptimizerState
from ..sync import SyncHandle
from .optimizer_build import OptimizerArg

LossFn = Callable[[Any, Any], torch.Tensor]
"""``loss_fn(output, target) -> loss``, as :meth:`Accelerated.train_step` takes it."""


class Pipeline(Protocol):
    """Forward and backward of one micro-step run together in a pipeline schedule."""

    def run(self, inputs: torch.Tensor, target: Any, loss_fn: LossFn) -> torch.Tensor:
        """Run the schedule over ``inputs``/``target``; return the micro-step's loss
        (mean over pipeline micro-batches, detached) on every rank of the pipeline.
        Gradients are accumulated in the stage's parameters, tied copies summed."""
        ...


class Layout(Protocol):
    """One way of laying the model over the ranks (see the module docstring)."""

    model: nn.Module
    """``run.model``: the front module. Its forward runs under autocast where the layout
    does not cast itself, counts samples, and arms gradient synchronisation on the last
    micro-step only (every wrapper gets these in its constructor, as a ForwardContext)."""
    module: nn.Module
    """The plain model, or this rank's pipeline stage, with the original parameter names."""
    sync: SyncHandle | None
    """The gradient-sync strategy's state (DDP hook strategies, and ``diloco`` across dp_shard
    replicas); None where FSDP2 alone reduces."""
    pipeline: Pipeline | None
    """Set with pipeline parallelism: then ``run.train_step`` is the only way to train."""
    dp_rank: int
    """This rank's index among the data-parallel ranks: pick the data slice by it."""
    dp_size: int
    """How many data-parallel ranks there are (global batch = per-rank batch * dp_size)."""

    # --- healing in place (slipstream.resilience.heal): the facade calls these, in this order ------------
    def heal_refusal(self) -> str | None:
        """Why this layout cannot heal in place, in one line (None: it can). Deterministic:
        a replacement decides as its predecessor did."""
        ...

    def release(self) -> None:
        """After a failed collective, before the healer destroys the broken default group: drop
        the references to groups of the layout's own and close them, so a peer blocked in one
        of them fails now instead of waiting on this rank."""
        ...

    def leave(self) -> None:
        """After a failed collective, once the broken default group (every group with it) was
        destroyed: let go of every reference to those groups, so their sockets close, and drop
        what the failed step left in flight."""
        ...

    def rejoined(self) -> None:
        """After the default group was formed again: everything that held the old groups moves
        to new ones. A collective: every rank calls it, in the same order, before the facade
        restores the in-memory snapshot."""
        ...

    def describe(self) -> str:
        """The layout in words, e.g. ``pp(1) x dp_replicate(2) x dp_shard(1) x tp(1)``."""
        ...

    def optimizer_for(self, optimizer: OptimizerArg) -> torch.optim.Optimizer:
        """The optimizer over this layout's parameters: as given, built by a factory,
        or rebuilt (same class and groups) where the layout replaced the parameters."""
        ...

    def global_grad_norm(self) -> torch.Tensor:
        """The 2-norm of the whole model's gradient (a device tensor: no host sync).
        A collective where the gradients are sharded: call it on every rank."""
        ...

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so their global 2-norm is at most ``max_norm``;
        returns the norm before clipping (same collective rules as global_grad_norm)."""
        ...

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> ModelOptimizerState:
        """The model and optimizer as one checkpoint entry, keyed by original names."""
        ...

    def unwrapped_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state_dict, original names (a collective where sharded)."""
        ...
