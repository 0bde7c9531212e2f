"""Checkpoints on torch.distributed.checkpoint (DCP): atomic, keep-last-k, async, auto-resume."""

from .layout import CheckpointDir, find_latest
from .manager import CheckpointManager

__all__ = ["CheckpointDir", "CheckpointManager", "find_latest"]
