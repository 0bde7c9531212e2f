"""Timeline: compute and communication spans per rank in Chrome trace format.

Each rank streams complete events (``"ph": "X"``, microseconds) to
``RUN_DIR/timeline/rank<R>.json`` in the JSON *array* form of the Trace Event
Format, so a file cut short by a crash still loads (the closing ``]`` is
optional). Process id = rank, thread 1 = compute, thread 2 = communication.
Timestamps are wall-clock microseconds (perf_counter anchored to time.time()
once), so ranks of one machine line up. ``merge()`` (run by ``slipstream
report``) writes all ranks into one ``timeline.json`` that opens in Perfetto
(ui.perfetto.dev) or chrome://tracing.

Example::

    tl = TimelineWriter("runs/x/timeline/rank0.json", rank=0)
    tl.write_spans([Span("forward", start_s=time.perf_counter(), dur_s=0.01, step=1)])
    tl.close()
"""

from __future__ import annotations

import glob
import json
import os
import time
from collections.abc import Iterable
from typing import Any

from .profiler import COMM_PHASES, Span

COMPUTE_TID, COMM_TID = 1, 2


class TimelineWriter:
    """Streams one rank's spans. Every step up to ``full_steps``, then one step in
    ``sample_every`` (about 1 KB per step written: a long run stays loadable)."""

    def __init__(self, path: str, rank: int, full_steps: int = 2000, sample_every: int = 100) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self.rank = rank
        self.full_steps = full_steps
        self.sample_every = sample_every
        # One anchor: host perf_counter -> wall clock, so ranks line up.
        self._offset_us = time.time() * 1e6 - time.perf_counter() * 1e6
        self._file = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        for event in (
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": COMPUTE_TID, "args": {"name": "compute"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": COMM_TID, "args": {"name": "communication"}},
        ):
            self._emit(event)
        self._file.flush()

    def _emit(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def write_spans(self, spans: Iterable[Span]) -> None:
        for s in spans:
            if s.step > self.full_steps and s.step % self.sample_every:
                continue
            self._emit(
                {
                    "name": s.phase,
                    "cat": "comm" if s.phase in COMM_PHASES else "compute",
                    "ph": "X",
                    "ts": round(s.start_s * 1e6 + self._offset_us, 3),
                    "dur": round(s.dur_s * 1e6, 3),
                    "pid": self.rank,
                    "tid": COMM_TID if s.phase in COMM_PHASES else COMPUTE_TID,
                    "args": {"step": s.step},
                }
            )
        self._file.flush()

    def write_counter(self, name: str, ts_s: float, values: dict[str, float]) -> None:
        """A counter track (``"ph": "C"``), e.g. loss or throughput at log steps."""
        self._emit({"name": name, "ph": "C", "ts": round(ts_s * 1e6 + self._offset_us, 3), "pid": self.rank, "args": values})

    def close(self) -> None:
        if not self._file.closed:
            # A last metadata event without a trailing comma closes the array properly.
            self._file.write(
                json.dumps({"name": "process_labels", "ph": "M", "pid": self.rank, "tid": 0, "args": {"labels": "slipstream"}})
                + "\n]\n"
            )
            self._file.close()


def load_events(path: str) -> list[dict[str, Any]]:
    """Events of one rank's file, also when it was cut short (no closing bracket)."""
    with open(path, encoding="utf-8") as f:
        text = f.read().strip()
    if not text:
        return []
    if not text.endswith("]"):
        text = text.rstrip().rstrip(",") + "]"
    data = json.loads(text)
    return data["traceEvents"] if isinstance(data, dict) else data


def merge(run_dir: str, out_path: str | None = None) -> str | None:
    """Merge ``RUN_DIR/timeline/rank*.json`` into one trace; returns its path (None if none)."""
    paths = sorted(glob.glob(os.path.join(run_dir, "timeline", "rank*.json")))
    if not paths:
        return None
    events: list[dict[str, Any]] = []
    for p in paths:
        events.extend(load_events(p))
    out_path = out_path or os.path.join(run_dir, "timeline.json")
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f, separators=(",", ":"))
    return out_path


__all__ = ["COMM_TID", "COMPUTE_TID", "TimelineWriter", "load_events", "merge"]
