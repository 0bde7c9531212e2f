"""Slipstream: fast, survivable distributed training on PyTorch.

Public API::

    import slipstream
    rt = slipstream.init()                                   # process group, device
    run = slipstream.accelerate(model, optimizer, precision="bf16")
    for x, y in loader:
        loss = loss_fn(run.model(x), y)
        run.backward(loss)
        run.step()
"""

from .config import TrainConfig
from .errors import ConfigError, SlipstreamError
from .runtime import Runtime, init, shutdown
from .train import LAMB, Accelerated, accelerate, scaled_lr, warmup_schedule

__version__ = "0.1.0"

__all__ = [
    "LAMB",
    "Accelerated",
    "ConfigError",
    "Runtime",
    "SlipstreamError",
    "TrainConfig",
    "__version__",
    "accelerate",
    "init",
    "scaled_lr",
    "shutdown",
    "warmup_schedule",
]
