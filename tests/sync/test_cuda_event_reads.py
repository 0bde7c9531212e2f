"""CUDA event timings are read only after the events completed, taken on the CPU (issue #42).

On a GPU a mark carries a CUDA event, and ``elapsed_time`` on an event the device has not
reached yet raises ("device not ready"); on the CPU a mark is a host reading and any read
works, so the CPU suite cannot see a read that comes too early. Here ``torch.cuda.Event``
is a strict stand-in: an event completes only when ``synchronize()`` is called on it or on
a later event of the same stream (a stream runs in order), and reading a duration of an
event that has not completed raises as CUDA does. ``auto``'s codec timing and the step
accounting (whose marks come from several streams) must read only completed events.
"""

from __future__ import annotations

import time

import pytest
import torch

from slipstream.network.link import Link
from slipstream.process.timing import CudaClock
from slipstream.sync.accounting import StepRecord
from slipstream.sync.auto import AutoPolicy
from slipstream.sync.compress.base import layout_from_shapes
from slipstream.sync.control import ControlWire
from slipstream.sync.options import SyncOptions

CPU = torch.device("cpu")


class _Streams:
    current = "default"


class StrictEvent:
    """torch.cuda.Event as the device sees it: complete only once waited for, in stream order."""

    recorded: list["StrictEvent"] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "an event without timing has no elapsed_time"
        self.stream: str | None = None
        self.t = 0.0
        self.done = False

    def record(self, stream=None) -> None:
        self.stream, self.t, self.done = _Streams.current, time.perf_counter(), False
        StrictEvent.recorded.append(self)

    def synchronize(self) -> None:
        assert self.stream is not None, "synchronize() on an event never recorded"
        mine = [e for e in StrictEvent.recorded if e.stream == self.stream]
        for e in mine[: mine.index(self) + 1]:
            e.done = True

    def elapsed_time(self, end: "StrictEvent") -> float:
        for e in (self, end):
            if e.stream is None or not e.done:
                raise RuntimeError("CUDA error: device not ready (an event read before it completed)")
        return (end.t - self.t) * 1e3


@pytest.fixture
def strict_events(monkeypatch):
    StrictEvent.recorded = []
    _Streams.current = "default"
    monkeypatch.setattr(torch.cuda, "Event", StrictEvent)
    return StrictEvent


def test_the_stand_in_refuses_an_early_read(strict_events):
    clock = CudaClock(torch.device("cuda", 0))
    a, b = clock.mark(), clock.mark()
    with pytest.raises(RuntimeError, match="device not ready"):
        a[1].elapsed_time(b[1])
    clock.synchronize([a, b])  # one stream: waiting for the last completes both
    assert a[1].elapsed_time(b[1]) >= 0.0


def test_auto_times_its_codecs_from_completed_events_only(strict_events):
    """measure_costs with the GPU's clock: every duration it reads was waited for (one wait per
    codec, on the last mark, plus one after the second run where a codec may be too slow)."""
    shapes = [(64, 64), (64,)]
    torch.manual_seed(0)
    flat = torch.randn(sum(torch.Size(s).numel() for s in shapes))
    key = (0, 1)
    step = StepRecord(t_backward_start=None)
    step.numel[0], step.keys[0], step.outputs[0] = flat.numel(), key, flat
    slow = Link.measured(ranks=2, alpha_s=1e-4, bytes_per_s=25e6)
    auto = AutoPolicy(SyncOptions(), ControlWire(None), world_size=2, link=slow, prober=lambda: slow)
    costs = auto.measure_costs([0], step, CudaClock(torch.device("cuda", 0)), CPU, {key: layout_from_shapes(shapes)})
    lossy = [name for (_, name) in costs if name != "allreduce"]
    assert lossy and all(costs[(0, name)] > 0.0 for name in lossy), costs


def test_a_steps_marks_from_several_streams_are_each_waited_for(strict_events):
    """The backward's ready marks, the comm thread's collective spans and the done mark are on
    different streams: resolve() must wait for each (waiting for the last of one stream
    leaves the others' events incomplete)."""
    clock = CudaClock(torch.device("cuda", 0))
    step = StepRecord(t_backward_start=clock.mark())
    for i in range(3):
        step.ready[i] = clock.mark()
    step.t_last_ready = step.ready[2]
    _Streams.current = "comm"
    step.comm_spans = [(clock.mark(), clock.mark()) for _ in range(3)]
    _Streams.current = "callback"
    step.t_done = clock.mark()
    step.resolve(clock)
    assert step.resolved and step.span_s >= step.exposed_s >= 0.0 and len(step.ready_s) == 3
    assert all(e.done for e in StrictEvent.recorded)
