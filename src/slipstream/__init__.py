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
"""

from .config import TrainConfig
from .errors import EXIT_PREEMPTED, ConfigError, SlipstreamError
from .runtime import Runtime, init, shutdown
from .train import LAMB, Accelerated, StepResult, accelerate, scaled_lr, warmup_schedule

__version__ = "0.1.0"

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
