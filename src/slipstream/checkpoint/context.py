"""What the parts of one :class:`~slipstream.checkpoint.manager.CheckpointManager` share.

The manager is a facade over three collaborators: the save path (:mod:`.saving`), the
load path (:mod:`.restoring`) and the in-memory snapshots (:mod:`.snapshot_side`), with
the save clock and stop request in :mod:`.schedule`. Each of them reads the facts below
from one :class:`ManagerContext` at the time it needs them, never from a copy: a heal in
place replaces the groups (:meth:`~.manager.CheckpointManager.rejoined`), and a save or
a restore moves the newest agreed step that every part branches on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.stateful import Stateful

from ..config import CheckpointConfig


@dataclass
class ManagerContext:
    """One manager's settings, place, rank, groups, registry and newest save.

    ``settings``: the checked settings (:class:`~slipstream.config.CheckpointConfig`, whose
    ``__post_init__`` holds every bound). ``directory``: where checkpoints go (a local path or
    an fsspec URL; None: in-memory snapshots only); ``fs``: the URL's fsspec filesystem, None
    for a local directory. ``group``/``writer_group``: the checkpoint's gloo groups (None in a
    single process, and between a heal's :meth:`left` and :meth:`rejoined`).
    """

    settings: CheckpointConfig
    directory: str | None
    fs: Any
    storage_options: dict[str, Any]
    rank: int
    world_size: int
    group: Any = None
    writer_group: Any = None
    shared: dict[str, Stateful] = field(default_factory=dict)  # saved through DCP, loadable at any world size
    per_rank: dict[str, Stateful] = field(default_factory=dict)  # one rank<R>.pt per rank
    # The newest step every rank agreed was written (or restored): set only after an
    # agreement, so a branch before a collective may read it (save_final does).
    last_saved_step: int | None = None
    last_save_time: float = field(default_factory=time.monotonic)  # every_s counts from here
    preempt_requested: bool = False  # SIGTERM reached this rank (rank-local until agreed)

    @property
    def many(self) -> bool:
        """True when the ranks must agree through ``group`` (several ranks, groups formed)."""
        return self.group is not None and self.world_size > 1
