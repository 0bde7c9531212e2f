"""What train_step does on the host between the user's forward, backward and optimizer (issue #42).

On a GPU a step is asynchronous: a host sync on the hot path (``.item()``, ``float(t)``,
``bool(t)``, ``tolist()``, ``torch.cuda.synchronize()``) drains the queue every step, and
work the wrapper adds per step is kernel launches the plain loop does not make. These
tests run on the CPU and count what a GPU would pay for:

* no host sync on a step that is not a log step (the loss and the gradient norm are
  read back once per log window), in every precision and with clipping and accumulation;
* one rank does no reducer work (DDP would copy every gradient into its bucket, reduce
  it with itself and broadcast the buffers at every forward) and trains bit for bit as
  the plain loop does.

Counts, not times: performance figures live in benchmarks/host_overhead.py.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import slipstream

LOG_EVERY = 5
# Ops that read a tensor's value back to the host: on a GPU each waits for the queue to drain.
READ_BACK_OPS = {"_local_scalar_dense", "is_nonzero", "equal", "item"}


class HostSyncCounter(TorchDispatchMode):
    """Counts, by name, every op that reads a tensor back to the host, and every call of the
    Python-level ways to do so that do not go through the dispatcher."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        for owner, name in ((torch.Tensor, "tolist"), (torch.Tensor, "numpy"), (torch.cuda, "synchronize"),
                            (torch.cuda.Event, "synchronize"), (torch.cuda.Event, "elapsed_time")):
            original = getattr(owner, name)
            monkeypatch.setattr(owner, name, self._counting(f"{getattr(owner, '__name__', owner)}.{name}", original))

    def _counting(self, label: str, original):
        def call(*args, **kwargs):
            self.counts[label] += 1
            return original(*args, **kwargs)

        return call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READ_BACK_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 32, (4, 7), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.mark.parametrize("options", [
    {"precision": "fp32"},
    {"precision": "bf16", "grad_clip_norm": 1.0},
    {"precision": "bf16", "accumulate_steps": 2},
], ids=["fp32", "bf16-clip", "bf16-accumulate"])
def test_no_host_sync_outside_log_steps(single_process, monkeypatch, tmp_path, options):
    model = _model()
    # SGD: torch's own optimizer makes no read-back (AdamW's CPU path reads its step count).
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = slipstream.accelerate(model, opt, run_dir=str(tmp_path / "run"), log_every_steps=LOG_EVERY,
                                progress=False, **options)
    micro = options.get("accumulate_steps", 1)
    counter = HostSyncCounter(monkeypatch)
    per_micro_step = []  # (logged, read-backs) of each micro-step
    for i in range(micro * (2 * LOG_EVERY + 1)):
        counter.counts.clear()
        before = run.step_count
        with counter:
            loss = run.train_step(*_batch(i), _loss)
        logged = run.step_count != before and run.step_count % LOG_EVERY == 0
        per_micro_step.append((logged, dict(counter.counts)))
        assert isinstance(loss, torch.Tensor) and loss.grad_fn is None  # the loss stays a tensor: no read-back
    run.finish()
    quiet = [counts for logged, counts in per_micro_step if not logged]
    assert len(quiet) == len(per_micro_step) - 2
    assert all(counts == {} for counts in quiet), f"host syncs outside log steps: {[q for q in quiet if q]}"
    logged = [counts for logged, counts in per_micro_step if logged]
    assert len(logged) == 2 and all(c.get("_local_scalar_dense", 0) >= 1 for c in logged)  # the loss, read there


def _op_counts(fn, steps: int) -> collections.Counter[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            fn(i)
    return collections.Counter(e.name for e in prof.events())


def test_one_rank_does_no_reducer_work_and_trains_as_the_plain_loop(single_process, tmp_path):
    # A buffer, so that DDP would broadcast it at every forward.
    plain = _model()
    plain.register_buffer("scale", torch.ones(()))
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)

    def plain_step(i: int) -> None:
        _loss(plain(_batch(i)[0]), _batch(i)[1]).backward()
        plain_opt.step()
        plain_opt.zero_grad(set_to_none=True)

    model = _model()
    model.register_buffer("scale", torch.ones(()))
    run = slipstream.accelerate(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=str(tmp_path / "run"),
                                log_every_steps=LOG_EVERY, progress=False)
    run.train_step(*_batch(0), _loss)  # DDP's first forward rebuilds its buckets and broadcasts, once
    ops = _op_counts(lambda i: run.train_step(*_batch(i + 1), _loss), 2 * LOG_EVERY)
    reducer_work = {name: n for name, n in ops.items()
                    if "reducer" in name or name.startswith(("c10d::", "gloo:")) or "broadcast" in name}
    assert reducer_work == {}, f"one rank, yet DDP's reducer worked: {reducer_work}"
    for i in range(1 + 2 * LOG_EVERY):
        plain_step(i)
    for (name, a), b in zip(plain.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs from the plain loop's"
    run.finish()
