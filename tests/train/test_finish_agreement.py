"""finish() takes the same branch on every rank (issue #32, item 2).

Its final save is a collective (the lease check's all-reduce first), so whether to
write it must be decided on a value every rank agrees on, never on rank 0's
writer thread having committed an asynchronous save already.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT_S = "5"  # a rank left alone in a collective fails in seconds, not the default 600


def _finish_after_the_commit_landed(rank: int, world_size: int, directory: str, run_dir: str) -> dict:
    import slipstream
    from slipstream.checkpoint import layout

    slipstream.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = slipstream.accelerate(model, opt, progress=False, run_dir=run_dir, checkpoint_dir=directory,
                                checkpoint_every_steps=2, checkpoint_async=True)
    g = torch.Generator().manual_seed(rank)
    for _ in range(4):  # the last step's save (step 4) is asynchronous and still in flight
        run.train_step(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g), F.cross_entropy)
    if rank == 0:
        # Rank 0's writer thread commits step 4 before finish() looks; rank 1 never commits.
        assert run.checkpoints._committed.wait(timeout=60)
    summary = run.finish()
    mgr = run.checkpoints
    complete = [c.step for c in layout.list_complete(directory)]
    slipstream.shutdown()
    return {"steps": summary["steps"], "last_saved_step": mgr.last_saved_step, "complete": complete,
            "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def test_finish_agrees_when_rank_0s_async_commit_landed_first(tmp_path):
    directory = str(tmp_path / "ckpt")
    results = run_ranks(_finish_after_the_commit_landed, 2, directory, str(tmp_path / "run"),
                        env={"SLIPSTREAM_COLLECTIVE_TIMEOUT_S": TIMEOUT_S}, timeout_s=120)
    for done in results:
        assert done["last_saved_step"] == 4, done
        assert done["complete"][-1] == 4, done
    assert results[0]["complete"] == results[1]["complete"]
    for name, value in results[0]["weights"].items():  # the ranks hold (and saved) one model
        assert torch.equal(value, results[1]["weights"][name]), name

    # The final checkpoint is complete and holds that model: a fresh manager loads it.
    from slipstream.checkpoint import CheckpointManager
    from slipstream.checkpoint.states import ModelOptimizerState

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    mgr = CheckpointManager(directory, handle_sigterm=False)
    mgr.register("model_optimizer", ModelOptimizerState(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    try:
        assert mgr.restore_latest() == 4
    finally:
        mgr.close()
    for name, value in model.state_dict().items():
        assert torch.equal(value, results[0]["weights"][name]), name
