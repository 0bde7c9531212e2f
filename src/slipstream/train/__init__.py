"""Training API: accelerate() (one facade over a layout strategy) and the optimizers/schedules for large batches."""

from ..parallel.activation_checkpointing import apply_activation_checkpointing
from .facade import Accelerated, accelerate
from .lamb import LAMB, scaled_lr, warmup_schedule
from .layout import Layout
from .step_result import StepResult

__all__ = [
    "LAMB",
    "Accelerated",
    "Layout",
    "StepResult",
    "accelerate",
    "apply_activation_checkpointing",
    "scaled_lr",
    "warmup_schedule",
]
