"""Slipstream: fast, survivable distributed training on PyTorch.

Public API::

    import slipstream
    rt = slipstream.init()                                   # process group, device
    run = slipstream.accelerate(model, optimizer, precision="bf16")
    for x, y in loader:
        loss = loss_fn(run.model(x), y)
        run.backward(loss)
        if run.step().stop_requested:   # SIGTERM: the emergency checkpoint is written
            break
    run.finish()

The names below are imported when first used (PEP 562), so ``import slipstream``
and the tooling that needs no torch (``slipstream --help``, ``slipstream plan``,
``slipstream validate``) start in a fraction of the time torch takes to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "TrainConfig": ".config",
    "ConfigError": ".errors",
    "EXIT_PREEMPTED": ".errors",
    "SlipstreamError": ".errors",
    "Runtime": ".process.runtime",
    "init": ".process.runtime",
    "shutdown": ".process.runtime",
    "LAMB": ".train",
    "Accelerated": ".train",
    "StepResult": ".train",
    "accelerate": ".train",
    "scaled_lr": ".train",
    "warmup_schedule": ".train",
}

__all__ = [
    "LAMB",
    "Accelerated",
    "ConfigError",
    "EXIT_PREEMPTED",
    "Runtime",
    "SlipstreamError",
    "StepResult",
    "TrainConfig",
    "__version__",
    "accelerate",
    "init",
    "scaled_lr",
    "shutdown",
    "warmup_schedule",
]

if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from .config import TrainConfig
    from .errors import EXIT_PREEMPTED, ConfigError, SlipstreamError
    from .process.runtime import Runtime, init, shutdown
    from .train import LAMB, Accelerated, StepResult, accelerate, scaled_lr, warmup_schedule


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
