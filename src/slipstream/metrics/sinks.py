"""Where step records go. A sink has ``write(record: dict)`` and ``close()``.

Records are flat dicts of JSON scalars: ``step``, ``time_s`` (since start),
``loss``, ``step_time_s``, ``samples_per_s``, ``tokens_per_s`` (when known),
``lr``, the profiler's phase times (``forward_s``, ``backward_s``,
``comm_exposed_s``, ...; see :mod:`.profiler`), memory, MFU, straggler fields,
plus anything a component adds (``sync_...``, ``data/...``). Lists (rank 0's
``busy_s_ranks``) and strings appear too; numeric sinks skip them.

Sinks here: :class:`JsonlSink`, :class:`ConsoleSink`; elsewhere in the
package: ``tensorboard.TensorBoardSink``, ``prometheus.PrometheusSink``, and the
experiment trackers ``trackers.WandbSink``, ``trackers.MlflowSink`` (``log_to``).
Your own: any object with these two methods, given as ``accelerate(sinks=[...])``.

Example::

    class PrintLoss:
        def write(self, record): print(record["step"], record.get("loss"))
        def close(self): pass
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
from typing import Any, Protocol


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, flushed per record so a crash loses at most one."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def eta_text(seconds: float) -> str:
    """``75`` -> ``"1m 15s"``: two units at most, as a person reads a remaining time."""
    s = round(max(0.0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def _fmt(record: dict[str, Any], total_steps: int | None = None, eta_s: float | None = None) -> str:
    step = f"step {record['step']}" + (f"/{total_steps}" if total_steps else "")
    parts = [step]
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("lr") is not None:
        parts.append(f"lr {record['lr']:.3g}")
    if record.get("samples_per_s") is not None:
        parts.append(f"{record['samples_per_s']:.1f} samples/s")
    if record.get("tokens_per_s") is not None:
        parts.append(f"{record['tokens_per_s']:.0f} tokens/s")
    if record.get("step_time_s") is not None:
        parts.append(f"{record['step_time_s'] * 1000:.1f} ms/step")
    if record.get("comm_exposed_s") is not None and record.get("step_time_s"):
        parts.append(f"comm {record['comm_exposed_s'] / record['step_time_s'] * 100:.0f}%")
    if record.get("mfu") is not None:
        parts.append(f"MFU {record['mfu'] * 100:.1f}%")
    if record.get("straggler_rank") is not None:
        parts.append(f"straggler rank {record['straggler_rank']} +{record.get('straggler_slowdown', 0) * 100:.0f}%")
    if eta_s is not None:
        parts.append(f"ETA {eta_text(eta_s)}")
    return " | ".join(parts)


class ConsoleSink:
    """A rich progress bar when stderr is a terminal, else one plain line per record:
    ``step N/total | loss | lr | ... | ETA`` (``step N`` and no ETA when the total is unknown).

    The ETA is the median step time of the last 64 log windows after the first (compilation and
    warm-up make the first slow) times the steps left; it uses only figures the record
    already holds, so it adds no host synchronisation.
    """

    def __init__(self, total_steps: int | None, use_progress_bar: bool | None = None) -> None:
        self.total_steps = total_steps
        tty = sys.stderr.isatty()
        self._bar = None
        if use_progress_bar if use_progress_bar is not None else tty:
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[status]}"),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total_steps, status="")
            self._bar.start()
        self._announced_rank: int | None = None
        self._first_step_s: float | None = None  # the warm-up window, used only while it is alone
        self._window_step_s: collections.deque[float] = collections.deque(maxlen=64)  # recent windows

    def _eta_s(self, record: dict[str, Any]) -> float | None:
        step_s = record.get("step_time_s")
        if isinstance(step_s, (int, float)):
            if self._first_step_s is None:
                self._first_step_s = float(step_s)
            else:
                self._window_step_s.append(float(step_s))
        left = (self.total_steps or 0) - int(record["step"])
        if left <= 0 or self._first_step_s is None:
            return None
        return statistics.median(self._window_step_s or [self._first_step_s]) * left

    def write(self, record: dict[str, Any]) -> None:
        line = _fmt(record, self.total_steps, self._eta_s(record))
        if self._bar is not None:
            self._bar.update(self._task, completed=record["step"], status=line)
        else:
            print(f"[slipstream] {line}", flush=True)
        # A straggler is announced once, and again when the verdict changes rank.
        message = record.get("straggler_message")
        key = record.get("straggler_rank")
        if message and key != self._announced_rank:
            if self._bar is not None:
                self._bar.console.print(f"[yellow]\\[slipstream] {message}")
            else:
                print(f"[slipstream] {message}", flush=True)
        self._announced_rank = key

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
