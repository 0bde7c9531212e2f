"""The profiler's cost per step stays within 2 % of a step (measured, not assumed)."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from slipstream.bench.overhead import hot_path_cost_s, mlp


def test_profiler_costs_under_two_percent_of_a_small_step():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = mlp(width=512, depth=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 512), torch.randint(0, 10, (64,))
    times = []
    for i in range(13):
        t0 = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    n_tensors = sum(1 for p in model.parameters())
    cost_s = min(hot_path_cost_s(n_tensors, steps=500) for _ in range(3))
    assert cost_s / step_s <= 0.02, f"profiler {cost_s * 1e6:.1f} us per step vs step {step_s * 1e3:.2f} ms"


def test_hot_path_cost_grows_with_hooked_tensors():
    # A sanity check that the measurement measures something: 400 hooks cost more than 4.
    small = min(hot_path_cost_s(4, steps=300) for _ in range(3))
    large = min(hot_path_cost_s(400, steps=300) for _ in range(3))
    assert large > small * 3
