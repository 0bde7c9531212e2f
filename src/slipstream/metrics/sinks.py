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
import logging
import os
import statistics
import sys
from typing import IO, Any, Protocol

from .terminal import TerminalDisplay, can_draw, eta_text, print_beside

log = logging.getLogger(__name__)


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


def status_parts(record: dict[str, Any]) -> list[str]:
    """The log step's fields as a person reads them, most useful first (the display drops
    fields from the end where the terminal is narrow): loss, lr, throughput, step time, exposed
    communication, MFU, the straggler tag."""
    parts = []
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
    if record.get("comm_exposed_s") is not None and record.get("step_time_s") and record.get("world_size", 2) > 1:
        parts.append(f"comm {record['comm_exposed_s'] / record['step_time_s'] * 100:.0f}%")
    if record.get("mfu") is not None:
        parts.append(f"MFU {record['mfu'] * 100:.1f}%")
    if record.get("straggler_rank") is not None:
        parts.append(f"straggler rank {record['straggler_rank']} +{record.get('straggler_slowdown', 0) * 100:.0f}%")
    return parts


def _fmt(record: dict[str, Any], total_steps: int | None = None, eta_s: float | None = None) -> str:
    step = f"step {record['step']}" + (f"/{total_steps}" if total_steps else "")
    parts = [step, *status_parts(record)]
    if eta_s is not None:
        parts.append(f"ETA {eta_text(eta_s)}")
    return " | ".join(parts)


class ConsoleSink:
    """Rank 0's console: a live display when stderr is a terminal (:mod:`.terminal`: the bar and
    the log step's fields on two lines cut to the width, lines printed above it), else one plain
    line per record: ``step N/total | loss | lr | ... | ETA`` (``step N`` and no ETA when the total
    is unknown). When another live display is up in the process (Lightning's, a Trainer's tqdm
    bar), the display steps aside and the plain lines go above that one.

    The ETA is the median step time of the last 64 log windows after the first (compilation and
    warm-up make the first slow) times the steps left; it uses only figures the record
    already holds, so it adds no host synchronisation.

    Nothing the display does raises: the training's exit code is never the display's.
    """

    def __init__(self, total_steps: int | None, use_progress_bar: bool | None = None,
                 stream: IO[str] | None = None) -> None:
        self.total_steps = total_steps
        terminal = stream if stream is not None else sys.stderr
        self._display: TerminalDisplay | None = None
        self._stream = terminal  # where plain lines go once the display stepped aside
        if use_progress_bar if use_progress_bar is not None else can_draw(terminal):
            self._display = TerminalDisplay(total_steps, terminal)
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

    def _say(self, line: str) -> None:
        """One plain line: on stdout without a display; beside the other display once ours stepped aside."""
        if self._display is None:
            print(f"[slipstream] {line}", flush=True)
            return
        try:
            print_beside(f"[slipstream] {line}", self._stream)
        except Exception as exc:  # noqa: BLE001 - never the display's exit code
            log.debug("progress line not printed: %r", exc)

    def write(self, record: dict[str, Any]) -> None:
        eta_s = self._eta_s(record)
        shown = self._display is not None and self._display.update(int(record["step"]), status_parts(record), eta_s)
        if not shown:
            self._say(_fmt(record, self.total_steps, eta_s))
        # A straggler is announced once, and again when the verdict changes rank.
        message = record.get("straggler_message")
        key = record.get("straggler_rank")
        if message and key != self._announced_rank:
            if not (self._display is not None and self._display.print_lines(f"[slipstream] {message}")):
                self._say(message)
        self._announced_rank = key

    def close(self) -> None:
        if self._display is not None:
            self._display.close()
