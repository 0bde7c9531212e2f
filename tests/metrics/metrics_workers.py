"""Rank functions for the metrics tests (spawned by harness.run_ranks: must be importable)."""

from __future__ import annotations

import json
import os
import time
import urllib.request

SLEEP_S = 0.03  # injected into rank 1's forward in the straggler run
STEPS = 16
LOG_EVERY = 2


def _model(rank: int, slow_rank: int | None, sleep_s: float):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    if rank == slow_rank:
        # The injected straggler: this rank's forward takes sleep_s longer.
        model[0].register_forward_pre_hook(lambda module, args: time.sleep(sleep_s))
    return model


def _train(rank: int, run_dir: str, steps: int, log_every: int, slow_rank: int | None, sleep_s: float,
           options: dict) -> dict:
    import torch
    import torch.nn.functional as F

    import slipstream

    model = _model(rank, slow_rank, sleep_s)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = slipstream.accelerate(model, opt, run_dir=run_dir, log_every_steps=log_every, progress=False, **options)
    # Count host read-backs (.item()): the profiler must add none between log steps.
    real_item = torch.Tensor.item
    calls = {"n": 0}

    def counting_item(self):
        calls["n"] += 1
        return real_item(self)

    torch.Tensor.item = counting_item
    items_per_step = []
    g = torch.Generator().manual_seed(1 + rank)
    try:
        for _ in range(steps):
            x = torch.randn(16, 32, generator=g)
            y = torch.randint(0, 4, (16,), generator=g)
            before = calls["n"]
            loss = F.cross_entropy(run.model(x), y)
            run.backward(loss)
            run.step()
            items_per_step.append(calls["n"] - before)
    finally:
        torch.Tensor.item = real_item
    scraped = None
    url_file = os.path.join(run_dir, "metrics", f"prometheus-rank{rank}.url")
    if os.path.exists(url_file):
        with open(url_file) as f:
            url = f.read().strip()
        with urllib.request.urlopen(url, timeout=10) as resp:
            scraped = resp.read().decode()
    summary = run.finish()
    with open(os.path.join(run_dir, "metrics", f"rank{rank}.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return {"summary": summary, "records": records, "items_per_step": items_per_step, "scraped": scraped, "url": url_file}


def train_twice(rank: int, world_size: int, base: str, steps: int, log_every: int, sleep_s: float) -> dict:
    import slipstream

    slipstream.init()
    control = _train(rank, os.path.join(base, "control"), steps, log_every, None, 0.0,
                     {"prometheus_port": 0, "tensorboard": True, "grad_clip_norm": 10.0})
    slow = _train(rank, os.path.join(base, "straggler"), steps, log_every, 1, sleep_s, {"timeline": True})
    return {"control": control, "straggler": slow}
