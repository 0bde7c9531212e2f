"""Checkpoints on torch.distributed.checkpoint (DCP): atomic, keep-last-k, async, auto-resume."""

from .layout import CheckpointDir, find_latest
from .lease import CheckpointDirInUse
from .manager import CheckpointManager, NoUsableCheckpoint
from .storage import CheckpointSaveFailed
from .verify import VERIFY_MODES

__all__ = [
    "VERIFY_MODES", "CheckpointDir", "CheckpointDirInUse", "CheckpointManager", "CheckpointSaveFailed", "NoUsableCheckpoint", "find_latest",
]
