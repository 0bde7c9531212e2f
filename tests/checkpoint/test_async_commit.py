"""An asynchronous save's commit (rename + prune) ends before the next save begins.

Regression: wait() used to return once the committed directory existed, while
the writer thread was still pruning; the prune then deleted the next save's
step_N.partial as debris, and that save failed (seen once in CI, in the
SIGKILL + async-save fault-tolerance test).
"""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from slipstream.checkpoint import layout
from slipstream.checkpoint.manager import CheckpointManager


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_next_save_waits_for_the_previous_commit_and_prune(tmp_path, monkeypatch):
    real_prune = layout.prune

    def slow_prune(*args, **kwargs):
        time.sleep(0.5)  # a slow file system: the writer thread is still pruning
        return real_prune(*args, **kwargs)

    monkeypatch.setattr(layout, "prune", slow_prune)
    manager = CheckpointManager(str(tmp_path), every_steps=1, keep_last=2, async_save=True, handle_sigterm=False)
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    counter = Counter()
    manager.register("model", model)
    manager.register("counter", counter, per_rank=True)
    for step in (1, 2, 3):
        counter.value = step
        manager.save(step)
    manager.wait()
    steps = [c.step for c in layout.list_complete(str(tmp_path))]
    assert steps == [2, 3], steps
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".partial")], os.listdir(tmp_path)
    # The newest checkpoint is whole: it loads.
    fresh, restored = nn.Linear(4, 4), Counter()
    reader = CheckpointManager(str(tmp_path), handle_sigterm=False)
    reader.register("model", fresh)
    reader.register("counter", restored, per_rank=True)
    assert reader.restore_latest() == 3
    assert restored.value == 3
    assert torch.equal(fresh.weight, model.weight)
