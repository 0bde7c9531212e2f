"""open_checkpoints hands the manager every CheckpointConfig setting, by the section's own field names."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

from slipstream.checkpoint import CheckpointManager
from slipstream.config import CheckpointConfig
from slipstream.train import bookkeeping


def test_every_checkpoint_setting_is_a_keyword_of_the_manager():
    keywords = set(inspect.signature(CheckpointManager).parameters)
    missing = [f.name for f in dataclasses.fields(CheckpointConfig) if f.name != "dir" and f.name not in keywords]
    assert missing == [], f"CheckpointConfig fields CheckpointManager does not take: {missing}"


def test_a_setting_added_to_the_section_reaches_the_manager(monkeypatch):
    """No copy in between: a new field (here one the manager already takes) arrives without an edit."""

    @dataclasses.dataclass(frozen=True)
    class Grown(CheckpointConfig):
        lease_interval_s: float = 7.0

    seen = {}

    class Manager:
        snapshots = None

        def __init__(self, directory, **kwargs):
            seen.update(kwargs, directory=directory)

        def register(self, *args, **kwargs):
            pass

    monkeypatch.setattr(bookkeeping, "CheckpointManager", Manager)
    config = SimpleNamespace(checkpoint=Grown(dir="ck", keep_last=5, every_s=2.5))
    bookkeeping.open_checkpoints(config, object(), object(), {}, None)
    assert seen["directory"] == "ck" and seen["keep_last"] == 5 and seen["every_s"] == 2.5
    assert seen["lease_interval_s"] == 7.0 and seen["snapshot_auto"] is False
