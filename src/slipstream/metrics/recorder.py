"""Step recorder: collects what a training step did, and writes it to sinks.

Design for growth: components report through ``add(name, value)`` (summed
until the next log point) or ``set(name, value)`` (last value wins), and
``StepRecorder.sources`` holds callables whose ``stats() -> dict`` are merged
into each record (the gradient-sync state reports bytes sent this way). The
loss stays on the device and is read back only every ``log_every_steps``
steps, so a step adds no host synchronisation.

Phase timing (see :mod:`.profiler`) goes through ``begin(phase)`` /
``end(phase, token)`` or ``with recorder.timed(phase):``; ``attach(model,
config)`` (a TrainConfig) hooks the model's parameters (for the backward/communication split)
and opens the sinks the config asks for (TensorBoard, Prometheus, timeline, and
on rank 0 the experiment trackers ``log_to`` names, see :mod:`.trackers`).
At each log step the ranks start an exchange of their busy times (one small
all_gather, not waited for) and name a straggler from the window before's, whose
exchange completed while this window trained: a slow link's round trip never
stalls a step.

Example::

    rec = StepRecorder(rank=0, world_size=2, run_dir="runs/x", log_every_steps=10)
    rec.add_loss(loss.detach()); rec.add_samples(64)
    with rec.timed("checkpoint"):
        save()
    rec.end_step(lr=0.01)
    rec.close()
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..config import TrainConfig
from ..errors import ConfigError, UsageError
from ..extras import pip_install_hint
from ..log import CONSOLE
from .memory import CudaMemory
from .profiler import (
    CudaClock,
    HostClock,
    StepProfiler,
    default_peak_flops,
    model_flops,
    process_rss_bytes,
    window_means,
)
from .sinks import ConsoleSink, JsonlSink, Sink
from .straggler import GATHERED, PendingGather, StragglerDetector, start_gather
from .timeline import TimelineWriter
from .trackers import open_trackers, require_trackers, run_params

log = logging.getLogger(__name__)


def _require_module(name: str, option: str) -> None:
    import importlib.util

    if importlib.util.find_spec(name) is None:
        raise ConfigError(f"{option} needs the {name} package: {pip_install_hint('metrics')}")


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
        profile: bool = True,
        clock: HostClock | CudaClock | None = None,
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
        # Profiling (phase timing); off: begin() returns None and end() does nothing.
        self.profiler: StepProfiler | None = StepProfiler(clock, communicates=world_size > 1) if profile else None
        self.timeline: TimelineWriter | None = None
        self.straggler: StragglerDetector | None = None
        self._pending_gather: PendingGather | None = None  # this window's busy times, in flight
        self.device = torch.device("cpu")
        self.memory: CudaMemory | None = None  # set by attach() on a CUDA device; reads, never resets
        self.n_params = 0
        self.flops_per_sample: float | None = None
        self.peak_flops: float | None = None
        self._peak_flops_given: float | None = None
        self._precision = "fp32"
        self.flops_formula: str | None = None
        self._phase_totals: dict[str, float] = {}
        self._phase_steps = 0

    # --- what components report ----------------------------------------------------
    def add_loss(self, loss: torch.Tensor) -> None:
        # One op on the device per step for an fp32 loss, no sync: the window's first loss is
        # copied (``.float()`` of an fp32 loss would be the caller's tensor itself, which a loop
        # may change in place after handing it over), the others are added into that copy in
        # place (``.to`` is no op for fp32; the same fp32 sums as before, without a new tensor
        # per step).
        loss = loss.detach()
        if self._loss_sum is None:
            self._loss_sum = loss.to(torch.float32, copy=True)
        else:
            self._loss_sum.add_(loss.to(torch.float32))
        self._loss_count += 1

    def add_samples(self, n: int) -> None:
        self._samples += n

    def add_tokens(self, n: int) -> None:
        self._tokens += n

    def add(self, name: str, value: float) -> None:
        self._sums[name] = self._sums.get(name, 0.0) + value

    def set(self, name: str, value: Any) -> None:
        self._last[name] = value

    # --- phase timing (hot path: no device synchronisation) -------------------------
    def begin(self, phase: str) -> Any:
        """Start timing ``phase`` (forward, backward, optimizer, checkpoint, ...); returns a token."""
        return self.profiler.begin(phase) if self.profiler is not None else None

    def end(self, phase: str, token: Any) -> None:
        """Stop timing ``phase`` started with ``begin``."""
        if self.profiler is not None and token is not None:
            self.profiler.end(phase, token)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """``with recorder.timed("checkpoint"): ...`` times the block as ``phase``."""
        token = self.begin(phase)
        try:
            yield
        finally:
            self.end(phase, token)

    # --- wiring ------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module, config: TrainConfig | None = None, device: torch.device | None = None,
               local_rank: int | None = None, extra_sinks: Sequence[Sink] = ()) -> None:
        """Instrument ``model`` and open the sinks ``config`` asks for (its ``metrics``
        section, and ``numerics.precision`` for the peak FLOP/s). Without a config,
        TrainConfig's defaults: the defaults are written there only. ``extra_sinks``
        (the user's own, from ``accelerate(sinks=...)``) receive every record too.

        Collective when ``world_size > 1`` only in that every rank must call it
        (the straggler gather then runs at every log step on every rank). The
        gradient norm is not measured here: the training facade reports it
        (``set("grad_norm", ...)``) on log steps and when it clips.

        Example::

            rec.attach(model, TrainConfig(timeline=True), device=torch.device("cuda", 0))
        """
        cfg = config if config is not None else TrainConfig()
        trackers = tuple(name for name in cfg.metrics.log_to if name != "tensorboard")
        tensorboard = cfg.metrics.tensorboard or "tensorboard" in cfg.metrics.log_to
        try:  # on every rank, before anything is opened: all ranks stop alike (exit 2)
            if tensorboard and self.run_dir is not None:
                _require_module("tensorboard", "tensorboard=True" if cfg.metrics.tensorboard else "log_to tensorboard")
            if trackers and self.run_dir is None:
                raise ConfigError(f"log_to {','.join(trackers)} needs a run directory (run_dir)")
            require_trackers(trackers, self.run_dir or ".")
        except ConfigError:
            self.close()
            raise
        self.sinks.extend(extra_sinks)
        if not cfg.metrics.profile:
            self.profiler = None
        self.device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
        self.memory = CudaMemory(self.device) if self.device.type == "cuda" else None
        if self.profiler is not None and self.device.type == "cuda" and isinstance(self.profiler.clock, HostClock):
            self.profiler.clock = CudaClock(self.device)
        params = [p for p in model.parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for p in params)
        if self.profiler is not None:
            self.profiler.install(params)
        self.flops_per_sample = cfg.metrics.flops_per_sample
        self._peak_flops_given = cfg.metrics.peak_flops
        self._precision = cfg.numerics.precision
        self.peak_flops = self._peak_flops_given or default_peak_flops(self.device, self._precision)
        import torch.distributed as dist

        if self.world_size > 1 and self.profiler is not None and dist.is_available() and dist.is_initialized():
            self.straggler = StragglerDetector(self.world_size, threshold=cfg.metrics.straggler_threshold)
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank)) if local_rank is None else local_rank
        if self.run_dir is not None and cfg.metrics.timeline and self.profiler is not None:
            self.timeline = TimelineWriter(os.path.join(self.run_dir, "timeline", f"rank{self.rank}.json"), self.rank)
        if self.run_dir is not None and tensorboard:
            from .tensorboard import TensorBoardSink

            self.sinks.append(TensorBoardSink(os.path.join(self.run_dir, "tensorboard", f"rank{self.rank}")))
        port = cfg.metrics.prometheus_port
        if port is not None:
            _require_module("prometheus_client", "prometheus_port")
            from .prometheus import PrometheusSink

            bind = port + local_rank if port else 0
            try:
                sink = PrometheusSink(self.rank, bind, addr=cfg.metrics.prometheus_addr)
            except OSError as exc:
                raise UsageError(f"cannot serve Prometheus metrics of rank {self.rank} on port {bind}: {exc}") from exc
            self.sinks.append(sink)
            if self.run_dir is not None:
                path = os.path.join(self.run_dir, "metrics", f"prometheus-rank{self.rank}.url")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(sink.url + "\n")
            if self.rank == 0:
                log.info(f"[slipstream] Prometheus metrics of rank 0 at {sink.url}", extra=CONSOLE)
        if trackers and self.rank == 0 and self.run_dir is not None:
            # Last, so that nothing above fails after a tracker run was created.
            # Rank 0 only: its record already holds the job's figures.
            self.sinks.extend(open_trackers(trackers, self.run_dir, run_params(cfg, self.world_size)))
        if self.run_dir is not None and self.rank == 0:
            self._write_run_info(config)
        # Steps start now: the set-up above (a tracker run takes seconds to open)
        # is not the first window's step time.
        self._start = self._window_start = time.perf_counter()

    @property
    def next_step_logs(self) -> bool:
        """Whether the step being closed next (``end_step``) is a log step (same on every rank)."""
        return (self.step + 1) % self.log_every_steps == 0

    def _write_run_info(self, config: TrainConfig | None) -> None:
        info: dict[str, Any] = {
            "world_size": self.world_size,
            "device": str(self.device),
            "n_params": self.n_params,
            "flops_per_sample": self.flops_per_sample,
            "peak_flops": self.peak_flops,
            "log_every_steps": self.log_every_steps,
            "started_unix_s": time.time(),
        }
        if config is not None:  # by flat name, as the CLI flags and SLIPSTREAM_* variables spell it
            info["config"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.flat().items()}
        os.makedirs(os.path.join(self.run_dir, "metrics"), exist_ok=True)  # type: ignore[arg-type]
        with open(os.path.join(self.run_dir, "metrics", "run.json"), "w", encoding="utf-8") as f:  # type: ignore[arg-type]
            json.dump(info, f, indent=1, default=str)

    # --- step boundary ---------------------------------------------------------------
    def end_step(self, **fields: Any) -> dict[str, Any] | None:
        """Close one optimizer step; returns the record when this step was logged."""
        self.step += 1
        self._window_steps += 1
        if self.profiler is not None:
            self.profiler.end_step(self.step)
        if self.step % self.log_every_steps != 0:
            return None
        record = self.flush(**fields)
        if self.profiler is not None:
            self.profiler.touch()  # the flush (gather, sinks) is not the next step's data wait
        return record

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
        record["samples"] = self._samples  # this rank, this window
        record["tokens"] = self._tokens
        means: dict[str, float] = {}
        if self.profiler is not None:
            rows = self.profiler.resolve()  # reads CUDA events: the window's one wait
            means = window_means(rows)
            if means:
                covered = sum(v for k, v in means.items() if k != "busy_s")
                means["other_s"] = max(0.0, record["step_time_s"] - covered)
                for k, v in means.items():
                    self._phase_totals[k] = self._phase_totals.get(k, 0.0) + v * len(rows)
                self._phase_steps += len(rows)
        flops, formula = model_flops(self._samples, self._tokens, self.n_params, self.flops_per_sample)
        if not self._peak_flops_given:
            # The TF32 switch may have changed since attach (set_float32_matmul_precision
            # after accelerate()): judge this window by the math now in use.
            self.peak_flops = default_peak_flops(self.device, self._precision)
        if flops is not None:
            self.flops_formula = formula
            record["model_flops_per_s"] = flops / elapsed
            if self.peak_flops:
                record["mfu"] = record["model_flops_per_s"] / self.peak_flops
        rss = process_rss_bytes()
        if rss is not None:
            record["mem_rss_bytes"] = rss
        if self.memory is not None:
            # The process's peaks so far: the counters are the user's too, so never reset (memory.py).
            record.update(self.memory.fields())
        record.update(self._sums)
        record.update(self._last)
        for source in self.sources:
            record.update(source())
        record.update(fields)
        # The profiler's per-step phases win over a component's figure of the same
        # name (a data loader's own data_wait_s), so the breakdown adds up.
        record.update(means)
        for key, value in record.items():
            if isinstance(value, torch.Tensor):
                record[key] = value.item()  # read back here, once per log window
        if self.straggler is not None:
            record.update(self._straggler_fields(record))
        self.total_samples += self._samples * self.world_size
        self.total_tokens += self._tokens * self.world_size
        if self.timeline is not None and self.profiler is not None:
            self.timeline.write_spans(self.profiler.spans)
        for sink in self.sinks:
            sink.write(record)
        self.last_record = record
        self._window_start, self._window_steps = now, 0
        self._loss_sum, self._loss_count = None, 0
        self._samples = self._tokens = 0
        self._sums = {}
        return record

    def _straggler_fields(self, record: dict[str, Any]) -> dict[str, Any]:
        """Start the all_gather of this window's busy times (every rank, every log step) and
        name a straggler from the previous window's, gathered while this one trained (none
        in the first record). The span ``straggler_gather`` is the time spent waiting for it."""
        assert self.straggler is not None
        mine = [float(record.get(k) or 0.0) for k in GATHERED]
        t0 = self.profiler.clock.mark() if self.profiler is not None else None
        previous, self._pending_gather = self._pending_gather, start_gather(mine, self.device)
        if previous is None:
            return {}
        vectors = previous.result()
        if self.profiler is not None and t0 is not None:
            self.profiler.add_span("straggler_gather", (t0[0], None), (time.perf_counter(), None))
        return self._verdict_fields(vectors)

    def _verdict_fields(self, vectors: list[list[float]]) -> dict[str, Any]:
        assert self.straggler is not None
        busy = [v[0] for v in vectors]
        verdict = self.straggler.observe(busy)
        out: dict[str, Any] = {
            "busy_s_max": max(busy),
            "busy_s_min": min(busy),
            "slowest_rank": max(range(len(busy)), key=lambda r: busy[r]),
            "straggler_rank": verdict.rank if verdict else None,
        }
        if verdict is not None:
            out["straggler_slowdown"] = verdict.slowdown
            out["straggler_excess_s"] = verdict.excess_s
            if self.rank == 0:
                out["straggler_message"] = verdict.message()
        if self.rank == 0:
            out["busy_s_ranks"] = busy
        return out

    def phase_means(self) -> dict[str, float]:
        """Mean seconds per step of each phase since the start (for summaries)."""
        if not self._phase_steps:
            return {}
        return {k: v / self._phase_steps for k, v in self._phase_totals.items()}

    def summary(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self._start
        out = {
            "steps": self.step,
            "elapsed_s": elapsed,
            "final_loss": self.last_record.get("loss") if self.last_record else None,
            "samples_per_s": self.total_samples / elapsed if self.total_samples else None,
            "tokens_per_s": self.total_tokens / elapsed if self.total_tokens else None,
        }
        out.update(self.phase_means())
        if self.straggler is not None and self.straggler.last is not None:
            out["straggler_rank"] = self.straggler.last.rank
            out["straggler_slowdown"] = self.straggler.last.slowdown
        return out

    def rejoined(self) -> None:
        """After the default group was formed again (healing in place): the straggler exchange in
        flight went with the old group; the next log step starts a new one."""
        self._pending_gather = None

    def close(self) -> None:
        self.flush()
        if self._pending_gather is not None:
            # The last window's exchange, which every rank started at the same log step: waited
            # for on every rank, so none leaves it unfinished; its verdict goes to summary()
            # unless the straggler report was switched off for the exit (the zero-change adopter).
            pending, self._pending_gather = self._pending_gather, None
            try:
                vectors = pending.result()
            except Exception as exc:  # noqa: BLE001 - a peer already gone: only the report is lost
                log.debug("the last straggler exchange did not complete: %s", exc)
            else:
                if self.straggler is not None:
                    self._verdict_fields(vectors)
        if self.profiler is not None:
            self.profiler.remove()
        if self.timeline is not None:
            self.timeline.close()
            self.timeline = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []
