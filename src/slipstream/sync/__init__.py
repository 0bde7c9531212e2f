"""Gradient synchronisation strategies, selected by name.

A strategy is applied to a DistributedDataParallel model once, after wrapping:
``apply(name, ddp_model)``. ``allreduce`` keeps DDP's own C++ reducer (fused
buckets that overlap the backward pass); the others register a DDP comm hook.

Example::

    from slipstream import sync
    sync.available()                 # ('allreduce', 'bf16', 'fp16')
    sync.apply("bf16", ddp_model)
"""

from __future__ import annotations

from typing import Callable

from torch.nn.parallel import DistributedDataParallel

_Strategy = Callable[[DistributedDataParallel], object]
_REGISTRY: dict[str, _Strategy] = {}


def register(name: str) -> Callable[[_Strategy], _Strategy]:
    """Register ``fn(ddp_model) -> state`` under ``name``."""

    def deco(fn: _Strategy) -> _Strategy:
        _REGISTRY[name] = fn
        return fn

    return deco


def available() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def apply(name: str, ddp_model: DistributedDataParallel) -> object:
    """Install strategy ``name`` on ``ddp_model``; returns its state object (or None)."""
    if name not in _REGISTRY:
        raise KeyError(f"unknown sync strategy {name!r}; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name](ddp_model)


@register("allreduce")
def _allreduce(ddp_model: DistributedDataParallel) -> None:
    # DDP's built-in reducer: bucketed all-reduce overlapping backward, averaged.
    return None


@register("bf16")
def _bf16(ddp_model: DistributedDataParallel) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp_model.register_comm_hook(None, default_hooks.bf16_compress_hook)


@register("fp16")
def _fp16(ddp_model: DistributedDataParallel) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp_model.register_comm_hook(None, default_hooks.fp16_compress_hook)
