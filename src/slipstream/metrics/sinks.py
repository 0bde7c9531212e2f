"""Where step records go. A sink has ``write(record: dict)`` and ``close()``.

Records are flat dicts of JSON scalars: ``step``, ``time_s`` (since start),
``loss``, ``step_time_s``, ``samples_per_s``, ``tokens_per_s`` (when known),
``lr``, plus anything a component adds (``sync/...``, ``data/...``).
"""

from __future__ import annotations

import json
import os
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


def _fmt(record: dict[str, Any]) -> str:
    parts = [f"step {record['step']}"]
    if record.get("loss") is not None:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("samples_per_s") is not None:
        parts.append(f"{record['samples_per_s']:.1f} samples/s")
    if record.get("tokens_per_s") is not None:
        parts.append(f"{record['tokens_per_s']:.0f} tokens/s")
    if record.get("step_time_s") is not None:
        parts.append(f"{record['step_time_s'] * 1000:.1f} ms/step")
    return " | ".join(parts)


class ConsoleSink:
    """A rich progress bar when stderr is a terminal, else one plain line per record."""

    def __init__(self, total_steps: int | None, use_progress_bar: bool | None = None) -> None:
        self.total_steps = total_steps
        tty = sys.stderr.isatty()
        self._bar = None
        if use_progress_bar if use_progress_bar is not None else tty:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

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

    def write(self, record: dict[str, Any]) -> None:
        line = _fmt(record)
        if self._bar is not None:
            self._bar.update(self._task, completed=record["step"], status=line)
        else:
            print(f"[slipstream] {line}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
