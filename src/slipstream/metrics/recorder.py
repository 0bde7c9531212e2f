"""Step recorder: collects what a training step did, and writes it to sinks.

Design for growth: components report through ``add(name, value)`` (summed
until the next log point) or ``set(name, value)`` (last value wins), and
``StepRecorder.sources`` holds callables whose ``stats() -> dict`` are merged
into each record (the gradient-sync state reports bytes sent this way). The
loss stays on the device and is read back only every ``log_every_steps``
steps, so a step adds no host synchronisation.

Example::

    rec = StepRecorder(rank=0, world_size=2, run_dir="runs/x", log_every_steps=10)
    rec.add_loss(loss.detach()); rec.add_samples(64)
    rec.end_step(lr=0.01)
    rec.close()
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch

from .sinks import ConsoleSink, JsonlSink, Sink


class StepRecorder:
    def __init__(
        self,
        rank: int,
        world_size: int,
        run_dir: str | None,
        log_every_steps: int = 10,
        total_steps: int | None = None,
        progress: bool = True,
        sinks: list[Sink] | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.run_dir = run_dir
        self.log_every_steps = log_every_steps
        self.sinks: list[Sink] = list(sinks or [])
        if sinks is None:
            if run_dir is not None:
                self.sinks.append(JsonlSink(os.path.join(run_dir, "metrics", f"rank{rank}.jsonl")))
            if rank == 0 and progress:
                self.sinks.append(ConsoleSink(total_steps))
        self.sources: list[Callable[[], dict[str, Any]]] = []
        self.step = 0
        self._start = time.perf_counter()
        self._window_start = self._start
        self._window_steps = 0
        self._loss_sum: torch.Tensor | None = None
        self._loss_count = 0
        self._samples = 0
        self._tokens = 0
        self._sums: dict[str, float] = {}
        self._last: dict[str, Any] = {}
        self.last_record: dict[str, Any] | None = None
        self.total_samples = 0
        self.total_tokens = 0

    # --- what components report ----------------------------------------------------
    def add_loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach().float()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    def add_samples(self, n: int) -> None:
        self._samples += n

    def add_tokens(self, n: int) -> None:
        self._tokens += n

    def add(self, name: str, value: float) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + value

    def set(self, name: str, value: Any) -> None:
        self._last[name] = value

    # --- step boundary ---------------------------------------------------------------
    def end_step(self, **fields: Any) -> dict[str, Any] | None:
        """Close one optimizer step; returns the record when this step was logged."""
        self.step += 1
        self._window_steps += 1
        if self.step % self.log_every_steps != 0:
            return None
        return self.flush(**fields)

    def flush(self, **fields: Any) -> dict[str, Any] | None:
        if self._window_steps == 0:
            return None
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        record: dict[str, Any] = {"step": self.step, "rank": self.rank, "time_s": round(now - self._start, 6)}
        # The one host sync of the window: the loss read-back.
        record["loss"] = (self._loss_sum / self._loss_count).item() if self._loss_count else None
        record["step_time_s"] = elapsed / self._window_steps
        # Throughput of the whole job, assuming every rank sees equal batches.
        record["samples_per_s"] = self._samples * self.world_size / elapsed if self._samples else None
        record["tokens_per_s"] = self._tokens * self.world_size / elapsed if self._tokens else None
        record.update(self._sums)
        record.update(self._last)
        for source in self.sources:
            record.update(source())
        record.update(fields)
        for key, value in record.items():
            if isinstance(value, torch.Tensor):
                record[key] = value.item()  # read back here, once per log window
        self.total_samples += self._samples * self.world_size
        self.total_tokens += self._tokens * self.world_size
        for sink in self.sinks:
            sink.write(record)
        self.last_record = record
        self._window_start, self._window_steps = now, 0
        self._loss_sum, self._loss_count = None, 0
        self._samples = self._tokens = 0
        self._sums = {}
        return record

    def summary(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self._start
        return {
            "steps": self.step,
            "elapsed_s": elapsed,
            "final_loss": self.last_record.get("loss") if self.last_record else None,
            "samples_per_s": self.total_samples / elapsed if self.total_samples else None,
            "tokens_per_s": self.total_tokens / elapsed if self.total_tokens else None,
        }

    def close(self) -> None:
        self.flush()
        for sink in self.sinks:
            sink.close()
