"""Rank function for the report tests (spawned by harness.run_ranks: must be importable)."""

from __future__ import annotations

STEPS = 24
LOG_EVERY = 2


def train_with_schedule(rank: int, world_size: int, run_dir: str) -> dict:
    """A real 2-rank run whose learning rate falls (StepLR) and whose gradients are clipped."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    import slipstream

    slipstream.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = slipstream.accelerate(model, opt, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 6, gamma=0.5),
                                run_dir=run_dir, log_every_steps=LOG_EVERY, total_steps=STEPS, progress=False,
                                grad_clip_norm=5.0)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        run.backward(F.cross_entropy(run.model(x), y))
        run.step()
    return run.finish()
