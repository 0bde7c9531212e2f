"""Clocks that time device work without stalling the device.

A *mark* is ``(host perf_counter seconds, device event or None)``. On CPU the
host time is the truth: nothing runs asynchronously. On CUDA a kernel or an
NCCL collective returns to the host at enqueue, so a host clock around it
measures the enqueue (near zero); the event, recorded on the current stream,
completes when the stream reaches it, and two events give the device time in
between. Events are read back later, at a point that waits anyway (a log
step, a one-off decision), never per bucket or per step.

Example::

    clock = clock_for(torch.device("cuda", 0))
    a = clock.mark(); y = model(x); b = clock.mark()
    ...                                       # later, once
    clock.synchronize([b]); duration_s(a, b)  # device seconds of the forward
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch

Mark = tuple[float, Any]


class HostClock:
    """Marks are host timestamps only (CPU work: nothing runs asynchronously)."""

    def mark(self) -> Mark:
        return (time.perf_counter(), None)

    def new_event(self) -> Any:
        return None

    def record(self, event: Any) -> None:
        pass

    def synchronize(self, marks: Iterable[Mark | None], streams: str = "one") -> None:
        pass


class CudaClock:
    """Marks carry a CUDA event recorded on the current stream: no host wait."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> Mark:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return (time.perf_counter(), event)

    def new_event(self) -> Any:
        return torch.cuda.Event(enable_timing=True)

    def record(self, event: Any) -> None:
        event.record()

    def synchronize(self, marks: Iterable[Mark | None], streams: str = "one") -> None:
        """Wait until the marks' events have completed, so durations can be read.

        ``streams="one"``: the marks were recorded on one stream, which completes
        them in order: waiting for the last one is enough (one wait per window).
        ``"many"``: marks from several streams (the backward's, a communication
        stream, callback streams) complete in no common order: each is waited for.
        """
        events = [m[1] for m in marks if m is not None and m[1] is not None]
        for event in events if streams == "many" else events[-1:]:
            event.synchronize()


def clock_for(device: torch.device) -> HostClock | CudaClock:
    """The clock that tells the truth about work on ``device``."""
    return CudaClock(device) if device.type == "cuda" else HostClock()


def duration_s(a: Mark, b: Mark) -> float:
    """Seconds from mark ``a`` to mark ``b``: device time when both carry events
    (both must have completed: see ``synchronize``), else host time."""
    if a[1] is not None and b[1] is not None:
        return max(0.0, a[1].elapsed_time(b[1]) / 1e3)
    return max(0.0, b[0] - a[0])


__all__ = ["CudaClock", "HostClock", "Mark", "clock_for", "duration_s"]
