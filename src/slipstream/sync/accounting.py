"""Bytes and times of the synchronising steps: what ``stats()`` reports and ``auto`` reads.

A :class:`StepRecord` is filled while one synchronising backward runs (bucket
ready marks, bytes per collective, collective spans) and turned into seconds
by :meth:`StepRecord.resolve` only where the host waits anyway: a log step
(``stats()``) or ``auto``'s few observe/verify steps. :class:`Ledger` keeps
the run's totals and the last complete step.

Example::

    ledger = Ledger()
    step = StepRecord(t_backward_start=clock.mark())
    step.bytes_sent += 4096.0
    ledger.finish(step, clock.mark())
    ledger.figures(clock)["sync_bytes_sent"]    # 4096.0
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from ..process.timing import Mark, duration_s


@dataclass
class StepRecord:
    """Accounting of one synchronising backward.

    Times are marks (:mod:`slipstream.process.timing`): CUDA events on GPUs, host
    clock readings on CPU. :meth:`resolve` turns them into seconds once,
    waiting for the events.
    """

    t_backward_start: Mark | None
    ready: dict[int, Mark] = field(default_factory=dict)
    numel: dict[int, int] = field(default_factory=dict)
    itemsize: dict[int, int] = field(default_factory=dict)  # bytes per gradient value (2: bf16/fp16 parameters)
    keys: dict[int, Hashable] = field(default_factory=dict)
    bytes_sent: float = 0.0
    uncompressed_bytes: float = 0.0
    inter_node_bytes: float | None = None  # hierarchical only: the part on the slow links
    pending: int = 0  # direct path: collectives launched and not yet completed
    last_seen: bool = False
    comm_spans: list[tuple[Mark, Mark]] = field(default_factory=list)
    t_last_ready: Mark | None = None
    t_done: Mark | None = None
    # auto's observe steps only: each bucket's reduced (averaged) gradient, by bucket index,
    # for measuring how much of it each candidate codec keeps. References to the tensors the
    # reducer returned, dropped once the decision is taken (no copies).
    outputs: dict[int, Any] = field(default_factory=dict)
    # Filled by resolve():
    ready_s: dict[int, float] = field(default_factory=dict)  # since t_backward_start
    comm_s: float = 0.0
    exposed_s: float = 0.0  # last bucket ready -> last collective done
    span_s: float = 0.0  # backward start -> last collective done
    resolved: bool = False

    def resolve(self, clock: Any) -> StepRecord:
        """Marks to seconds (once; waits for the step's events). Returns ``self``."""
        if self.resolved or self.t_done is None:
            return self
        marks = [self.t_backward_start, self.t_last_ready, self.t_done, *self.ready.values()]
        marks += [m for span in self.comm_spans for m in span]
        clock.synchronize(marks, streams="many")
        start = self.t_backward_start
        if start is not None:
            self.ready_s = {i: duration_s(start, m) for i, m in self.ready.items()}
            self.span_s = duration_s(start, self.t_done)
        self.comm_s = sum(duration_s(a, b) for a, b in self.comm_spans)
        if self.t_last_ready is not None:
            self.exposed_s = duration_s(self.t_last_ready, self.t_done)
        self.resolved = True
        return self


@dataclass
class Ledger:
    """The run's totals and its last complete synchronising step."""

    steps: int = 0
    bytes_sent_total: float = 0.0
    uncompressed_bytes_total: float = 0.0
    last: StepRecord | None = None

    def finish(self, step: StepRecord, done: Mark) -> None:
        """``step``'s last collective completed at ``done``: count it."""
        step.t_done = done
        self.steps += 1
        self.bytes_sent_total += step.bytes_sent
        self.uncompressed_bytes_total += step.uncompressed_bytes
        self.last = step

    def figures(self, clock: Any) -> dict[str, Any]:
        """The ``sync_*`` byte and time figures of ``stats()`` (waits for the last step's events)."""
        out: dict[str, Any] = {"sync_steps": self.steps, "sync_bytes_sent_total": self.bytes_sent_total}
        last = self.last
        if last is None:
            return out
        last.resolve(clock)
        out["sync_bytes_sent"] = last.bytes_sent
        out["sync_uncompressed_bytes"] = last.uncompressed_bytes
        out["sync_compression_ratio"] = last.uncompressed_bytes / last.bytes_sent if last.bytes_sent else 1.0
        out["sync_exposed_comm_s"] = last.exposed_s
        out["sync_comm_s"] = last.comm_s
        if last.inter_node_bytes is not None:
            out["sync_inter_node_bytes_sent"] = last.inter_node_bytes
        return out


__all__ = ["Ledger", "StepRecord"]
