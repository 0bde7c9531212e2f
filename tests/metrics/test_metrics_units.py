"""Pure pieces of the metrics stack: profiler arithmetic, device-event path, straggler logic, MFU."""

from __future__ import annotations

import time
from typing import ClassVar

import pytest
import torch
from torch import nn

from slipstream.metrics.profiler import (
    CudaClock,
    StepProfiler,
    model_flops,
    process_rss_bytes,
    window_means,
)
from slipstream.metrics.straggler import StragglerDetector


class FakeHost:
    """A host clock the test moves by hand."""

    def __init__(self):
        self.t = 100.0


class ScriptedClock:
    """HostClock semantics with a scripted time (so phase arithmetic is exact)."""

    def __init__(self, host: FakeHost):
        self.host = host

    def mark(self):
        return (self.host.t, None)

    def new_event(self):
        return None

    def record(self, event):
        pass

    def synchronize(self, marks):
        pass


def test_phases_data_wait_and_exposed_comm_are_split_exactly(monkeypatch):
    host = FakeHost()
    monkeypatch.setattr(time, "perf_counter", lambda: host.t)
    prof = StepProfiler(ScriptedClock(host))
    for _ in range(2):
        host.t += 0.004  # the loop fetches data
        t = prof.begin("forward"); host.t += 0.010; prof.end("forward", t)
        host.t += 0.001  # loss computation: "other"
        t = prof.begin("backward")
        host.t += 0.005; prof.grad_ready()
        host.t += 0.015; prof.grad_ready()  # last gradient accumulated at +20 ms
        host.t += 0.007  # waiting for the all-reduce
        prof.end("backward", t)
        t = prof.begin("optimizer"); host.t += 0.003; prof.end("optimizer", t)
        prof.end_step(1)
    rows = prof.resolve()
    assert len(rows) == 2
    first, second = rows
    assert first["data_wait"] == 0.0  # no previous step to measure from
    assert second["data_wait"] == pytest.approx(0.004)
    for row in rows:
        assert row["forward"] == pytest.approx(0.010)
        assert row["backward"] == pytest.approx(0.020)
        assert row["comm_exposed"] == pytest.approx(0.007)
        assert row["optimizer"] == pytest.approx(0.003)
    means = window_means(rows)
    assert means["busy_s"] == pytest.approx(0.002 + 0.010 + 0.020 + 0.003)
    grad_sync = [s for s in prof.spans if s.phase == "grad_sync"]
    assert grad_sync and grad_sync[0].dur_s == pytest.approx(0.022)  # first gradient -> reduced


def test_gradient_hooks_outside_run_backward_are_ignored(monkeypatch):
    host = FakeHost()
    monkeypatch.setattr(time, "perf_counter", lambda: host.t)
    prof = StepProfiler(ScriptedClock(host))
    model = nn.Linear(3, 2)
    assert prof.install(model.parameters()) == 2
    model(torch.randn(4, 3)).sum().backward()  # not through begin("backward"): no effect
    t = prof.begin("backward")
    host.t += 0.01
    model(torch.randn(4, 3)).sum().backward()  # hooks fire: last grad at +10 ms
    host.t += 0.02
    prof.end("backward", t)
    prof.end_step(1)
    (row,) = prof.resolve()
    assert row["backward"] == pytest.approx(0.01) and row["comm_exposed"] == pytest.approx(0.02)
    prof.remove()


class FakeEvent:
    """Stands in for torch.cuda.Event: records the simulated device time."""

    device_t = 0.0
    synced: ClassVar[list] = []

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = FakeEvent.device_t

    def elapsed_time(self, other):  # milliseconds, like CUDA
        return (other.t - self.t) * 1e3

    def synchronize(self):
        FakeEvent.synced.append(self)


def test_device_events_time_the_device_and_are_read_once_per_window(monkeypatch):
    """The CUDA path, without a GPU: host enqueue times differ from device times; events win."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    FakeEvent.synced = []
    host = FakeHost()
    monkeypatch.setattr(time, "perf_counter", lambda: host.t)
    prof = StepProfiler(CudaClock(torch.device("cuda", 0)))
    for step in range(3):
        t = prof.begin("forward"); host.t += 0.001; FakeEvent.device_t += 0.050; prof.end("forward", t)
        t = prof.begin("backward")
        FakeEvent.device_t += 0.080; prof.grad_ready()
        FakeEvent.device_t += 0.020; prof.grad_ready()
        FakeEvent.device_t += 0.030; host.t += 0.002
        prof.end("backward", t)
        t = prof.begin("optimizer"); FakeEvent.device_t += 0.010; prof.end("optimizer", t)
        prof.end_step(step + 1)
        assert FakeEvent.synced == []  # nothing waits for the device inside a step
    rows = prof.resolve()
    assert len(FakeEvent.synced) == 1  # one wait per log window, on the latest event
    for row in rows:
        assert row["forward"] == pytest.approx(0.050)  # device time, not the 1 ms of host time
        assert row["backward"] == pytest.approx(0.100)
        assert row["comm_exposed"] == pytest.approx(0.030)
        assert row["optimizer"] == pytest.approx(0.010)


def test_straggler_needs_persistence_and_reports_by_how_much():
    det = StragglerDetector(world_size=4, threshold=0.1, window=5, persist=3)
    assert det.observe([0.10, 0.10, 0.13, 0.10]) is None  # once is not persistent
    assert det.observe([0.10, 0.10, 0.13, 0.10]) is None
    v = det.observe([0.10, 0.10, 0.13, 0.10])
    assert v is not None and v.rank == 2
    assert v.slowdown == pytest.approx(0.3) and v.excess_s == pytest.approx(0.03)
    assert "rank 2" in v.message() and "30% slower" in v.message()


def test_straggler_ignores_noise_and_rotating_slowest_rank():
    det = StragglerDetector(world_size=2, threshold=0.1)
    for _ in range(10):
        assert det.observe([0.100, 0.105]) is None  # 5 %: below the threshold
    det = StragglerDetector(world_size=3, threshold=0.1)
    verdicts = [det.observe([0.2 if r == i % 3 else 0.1 for r in range(3)]) for i in range(9)]
    assert all(v is None for v in verdicts)  # a different rank each time is not a straggler


def test_straggler_verdict_moves_when_the_slow_rank_recovers():
    det = StragglerDetector(world_size=2, threshold=0.1)
    for _ in range(5):
        v = det.observe([0.1, 0.2])
    assert v.rank == 1
    for _ in range(5):
        v = det.observe([0.1, 0.1])
    assert v is None


def test_model_flops_formulas():
    assert model_flops(8, 8 * 128, 10**6, None) == (6.0 * 10**6 * 1024, "6*params*tokens")
    assert model_flops(8, 0, 10**6, 2.5e9) == (8 * 2.5e9, "flops_per_sample*samples")
    assert model_flops(8, 0, 10**6, None) == (None, None)


def test_rss_is_plausible():
    rss = process_rss_bytes()
    assert rss is not None and 10 * 2**20 < rss < 64 * 2**30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_window_loss_is_the_fp32_mean_and_owns_its_sum(dtype):
    from slipstream.metrics import StepRecorder

    rec = StepRecorder(rank=0, world_size=1, run_dir=None, log_every_steps=3, progress=False, profile=False)
    losses = [torch.tensor(v, dtype=dtype) for v in (2.5, 1.0 / 3.0, 7.125)]
    expected = sum(loss.to(torch.float32) for loss in losses) / 3  # fp32 copies, summed: the record's definition
    for loss in losses[:2]:
        rec.add_loss(loss)
        assert rec.end_step() is None
    rec.add_loss(losses[2])
    losses[0].add_(100.0)  # a loop reusing the tensor it handed over changes nothing recorded
    record = rec.end_step()
    assert record["loss"] == expected.item()


def test_one_process_counts_the_backwards_tail_as_backward_not_communication(monkeypatch):
    # At world size 1 nothing is synchronised: autograd's tail after the last gradient is backward
    # work (a one-process run once read "comm 58%").
    host = FakeHost()
    monkeypatch.setattr(time, "perf_counter", lambda: host.t)
    prof = StepProfiler(ScriptedClock(host), communicates=False)
    model = nn.Linear(3, 2)
    prof.install(model.parameters())
    t = prof.begin("backward")
    host.t += 0.01
    model(torch.randn(4, 3)).sum().backward()
    host.t += 0.02
    prof.end("backward", t)
    prof.end_step(1)
    (row,) = prof.resolve()
    assert row["backward"] == pytest.approx(0.03) and row["comm_exposed"] == 0.0
    assert not [s for s in prof.spans if s.phase in ("comm_exposed", "grad_sync")]
    prof.remove()
