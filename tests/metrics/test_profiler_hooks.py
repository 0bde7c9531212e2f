"""The step profiler hooks a bounded number of parameters, and still finds the first
and last gradient of the backward (the points its backward/comm split rests on)."""

from __future__ import annotations

import time

import torch
from torch import nn

from slipstream.metrics.profiler import MAX_GRAD_HOOKS, StepProfiler


def deep_model(layers: int = 30) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh()]
    return nn.Sequential(*blocks, nn.Linear(16, 3))  # 4 tensors a block: 122 parameter tensors


def live_hooks(model: nn.Module) -> int:
    """Post-accumulate hooks torch will call in a backward (read from torch, not the profiler)."""
    return sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for p in model.parameters())


def backward(prof: StepProfiler, model: nn.Module, step: int) -> None:
    x = torch.randn(8, 16)
    t = prof.begin("backward")
    model(x).square().mean().backward()
    prof.end("backward", t)
    prof.end_step(step)


def test_hooks_are_bounded_after_the_first_backward():
    model = deep_model()
    n_params = sum(1 for _ in model.parameters())
    assert n_params > 10 * MAX_GRAD_HOOKS
    prof = StepProfiler()
    prof.install(model.parameters())
    backward(prof, model, 1)  # learns the arrival order (every parameter hooked once)
    assert live_hooks(model) <= MAX_GRAD_HOOKS
    assert prof.hook_count == live_hooks(model)
    backward(prof, model, 2)
    assert live_hooks(model) <= MAX_GRAD_HOOKS
    prof.remove()
    assert live_hooks(model) == 0


def test_a_small_model_keeps_every_hook():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    prof = StepProfiler()
    assert prof.install(model.parameters()) == 4
    t = prof.begin("backward")
    model(torch.randn(2, 4)).sum().backward()
    prof.end("backward", t)
    assert live_hooks(model) == 4


def test_first_and_last_gradient_points_are_those_of_the_whole_backward():
    model = deep_model()
    prof = StepProfiler()
    prof.install(model.parameters())
    backward(prof, model, 1)
    prof.resolve()
    # Time every accumulation with hooks of the test's own, registered after the
    # profiler's (on a tensor, hooks run in registration order: ours second).
    arrivals: list[float] = []
    handles = [p.register_post_accumulate_grad_hook(lambda _p: arrivals.append(time.perf_counter()))
               for p in model.parameters()]
    backward(prof, model, 2)
    for h in handles:
        h.remove()
    prof.resolve()
    spans = {s.phase: s for s in prof.spans}
    arrivals.sort()
    # "backward" ends at the last gradient: after the second-to-last arrival, not after the last.
    last_mark = spans["backward"].start_s + spans["backward"].dur_s
    assert arrivals[-2] <= last_mark <= arrivals[-1]
    # "grad_sync" starts at the first gradient: before the first arrival the test saw, and
    # nothing else arrived in between.
    first_mark = spans["grad_sync"].start_s
    assert first_mark <= arrivals[0]
    assert spans["backward"].start_s <= first_mark
