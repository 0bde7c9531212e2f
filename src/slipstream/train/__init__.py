"""Training API: accelerate() and the optimizers/schedules for large batches."""

from .accelerator import Accelerated, accelerate
from .activation_checkpointing import apply_activation_checkpointing
from .lamb import LAMB, scaled_lr, warmup_schedule

__all__ = ["LAMB", "Accelerated", "accelerate", "apply_activation_checkpointing", "scaled_lr", "warmup_schedule"]
