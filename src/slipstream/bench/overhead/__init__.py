"""Measure what the step profiler costs, two ways.

1. **In isolation** (:func:`hot_path_cost_s`): the exact calls a profiled step
   makes (begin/end of forward, backward and optimizer, one post-accumulate
   hook per hooked parameter (at most ``MAX_GRAD_HOOKS`` after the first
   backward), ``end_step``, and the per-step share of ``resolve()`` at log
   time), timed in a loop with nothing else running. Deterministic enough to
   assert on.
2. **Side by side** (:func:`compare`): the same training run with ``profile=True``
   and ``profile=False`` in one process, steps alternating ABBA, medians of
   this thread's CPU time (robust on a shared machine) and of wall time.

Run (the benchmark MLP of docs/measuring.md: 8 x Linear(1024, 1024) + ReLU, batch 64)::

    python -m slipstream.bench.overhead                  # one process
    slipstream run -n 2 -m slipstream.bench.overhead     # two gloo ranks (includes the straggler gather)

A benchmark tool, not part of the engine: it lives with ``slipstream bench``; its
flags are parsed in ``slipstream/bench/overhead/cli.py`` (``python -m`` runs ``__main__.py``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
from torch import nn

from ...metrics.profiler import StepProfiler


@dataclass(frozen=True)
class OverheadRun:
    """What :func:`compare` measures: the MLP's shape, the batch, and how many steps."""

    width: int = 1024
    depth: int = 8
    batch: int = 64
    steps: int = 60
    """Steps of each configuration (profile on, profile off)."""
    log_every_steps: int = 10


def mlp(width: int = 1024, depth: int = 8, classes: int = 10) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def hot_path_cost_s(n_params: int, steps: int = 2000, log_every_steps: int = 10) -> float:
    """Seconds the profiler adds to one step with ``n_params`` hooked parameter tensors (CPU clock).

    Pass the profiler's ``hook_count`` (not the model's parameter count): after
    the first backward only that many are hooked.

    Example::

        hot_path_cost_s(18) * 1e6     # microseconds per step, ~20-60 on a laptop core
    """
    prof = StepProfiler()
    hook = prof.grad_ready
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        t = prof.begin("forward")
        prof.end("forward", t)
        t = prof.begin("backward")
        for _ in range(n_params):
            hook(None)
        prof.end("backward", t)
        t = prof.begin("optimizer")
        prof.end("optimizer", t)
        prof.end_step(step)
        if step % log_every_steps == 0:
            prof.resolve()
    return (time.perf_counter() - t0) / steps


def _step(run, x, y) -> tuple[float, float]:
    """One training step; (wall seconds, this thread's CPU seconds)."""
    w0, c0 = time.perf_counter(), time.thread_time()
    loss = nn.functional.cross_entropy(run.model(x), y)
    run.backward(loss)
    run.step()
    return time.perf_counter() - w0, time.thread_time() - c0


def compare(req: OverheadRun) -> str | None:
    """Run the MLP with the profiler on and off, alternating; returns the report of both medians
    on rank 0 (None on the other ranks). Collective: every rank calls it.

    Example::

        report = compare(OverheadRun(width=256, depth=48, steps=100))
        if report is not None:
            print(report)
    """
    import slipstream

    torch.set_num_threads(1)
    rt = slipstream.init()
    scratch = tempfile.TemporaryDirectory(prefix="slipstream-overhead-")  # JSONL goes here, not ./runs
    runs = {}
    for profile in (True, False):
        torch.manual_seed(0)
        model = mlp(req.width, req.depth)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        runs[profile] = slipstream.accelerate(
            model, opt, profile=profile, progress=False, log_every_steps=req.log_every_steps,
            run_dir=os.path.join(scratch.name, f"profile-{profile}"),
        )
    g = torch.Generator().manual_seed(rt.rank)
    x = torch.randn(req.batch, req.width, generator=g).to(rt.device)
    y = torch.randint(0, 10, (req.batch,), generator=g).to(rt.device)
    for run in runs.values():
        for _ in range(3):
            _step(run, x, y)  # warm-up
    # Steps alternate on/off (ABBA), so both see the same machine. Thread CPU time
    # is the robust figure on a shared machine (others' load barely moves it;
    # CPU autograd runs in this thread); wall time is reported beside it.
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}
    for i in range(req.steps):
        for profile in ((True, False) if i % 2 == 0 else (False, True)):
            w, c = _step(runs[profile], x, y)
            wall[profile].append(w)
            cpu[profile].append(c)
    on, off = statistics.median(wall[True]), statistics.median(wall[False])
    con, coff = statistics.median(cpu[True]), statistics.median(cpu[False])
    n_params = sum(1 for p in runs[True].module.parameters() if p.requires_grad)
    prof = runs[True].recorder.profiler
    n_hooks = prof.hook_count if prof is not None else 0
    iso = hot_path_cost_s(n_hooks, log_every_steps=req.log_every_steps)
    for run in runs.values():
        run.finish()
    scratch.cleanup()
    if not rt.is_main:
        return None
    return (
        f"world_size {rt.world_size}, {n_params} parameter tensors ({n_hooks} hooked), "
        f"{req.steps} steps per configuration, alternating\n"
        f"median thread CPU per step: profile on {con * 1e3:.2f} ms, off {coff * 1e3:.2f} ms, "
        f"ratio {con / coff:.4f} ({(con / coff - 1) * 100:+.2f} %)\n"
        f"median wall per step:       profile on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms, "
        f"ratio {on / off:.4f} ({(on / off - 1) * 100:+.2f} %)\n"
        f"profiler calls alone: {iso * 1e6:.1f} us per step = {iso / off * 100:.3f} % of the step"
    )


__all__ = ["OverheadRun", "compare", "hot_path_cost_s", "mlp"]
