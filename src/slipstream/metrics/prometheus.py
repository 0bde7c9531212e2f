"""Prometheus endpoint: one scrape target per rank, bound to 127.0.0.1 by default.

Names follow Prometheus conventions: a ``slipstream_`` prefix, base units in
the name (``_seconds``, ``_bytes``, ``_ratio``), monotonic counts as
``_total`` counters, and only low-cardinality labels (``rank``, and ``phase``
for the step-time breakdown). Gauges hold the mean over the last log window.

Exposed (each with label ``rank``):

=========================================  =======  =========================================
name                                       type     meaning
=========================================  =======  =========================================
slipstream_steps_total                     counter  optimizer steps done
slipstream_samples_total                   counter  samples this rank processed
slipstream_tokens_total                    counter  tokens this rank processed
slipstream_comm_sent_bytes_total           counter  gradient-sync bytes sent (``sync_bytes_sent_total``)
slipstream_step_duration_seconds           gauge    wall time per step
slipstream_step_phase_seconds{phase=...}   gauge    data_wait, forward, backward, comm_exposed, optimizer, checkpoint, other
slipstream_busy_seconds                    gauge    time per step outside gradient sync
slipstream_loss                            gauge    training loss
slipstream_learning_rate                   gauge    learning rate of the first param group
slipstream_grad_norm                       gauge    global gradient 2-norm (when clipping)
slipstream_samples_per_second              gauge    throughput of the whole job
slipstream_tokens_per_second               gauge    token throughput of the whole job
slipstream_model_flops_per_second          gauge    achieved model FLOP/s of this rank
slipstream_mfu_ratio                       gauge    model FLOPs utilisation, 0..1
slipstream_comm_compression_ratio          gauge    uncompressed / sent gradient bytes
slipstream_memory_rss_bytes                gauge    process resident set size
slipstream_cuda_memory_peak_allocated_bytes gauge   peak allocated in the window (CUDA)
slipstream_cuda_memory_peak_reserved_bytes gauge    peak reserved in the window (CUDA)
slipstream_straggler_rank                  gauge    rank named straggler, -1 when none
slipstream_straggler_slowdown_ratio        gauge    how much slower it is than the median (0.5 = 50%)
=========================================  =======  =========================================

Example::

    sink = PrometheusSink(rank=0, port=0)        # 0: any free port
    sink.url                                     # http://127.0.0.1:PORT/metrics
"""

from __future__ import annotations

from typing import Any

_GAUGES = {
    "step_time_s": ("slipstream_step_duration_seconds", "Wall time per optimizer step (mean over the last log window)."),
    "busy_s": ("slipstream_busy_seconds", "Time per step spent outside gradient synchronisation."),
    "loss": ("slipstream_loss", "Training loss (mean over the last log window)."),
    "lr": ("slipstream_learning_rate", "Learning rate of the first parameter group."),
    "grad_norm": ("slipstream_grad_norm", "Global gradient 2-norm before clipping."),
    "samples_per_s": ("slipstream_samples_per_second", "Samples per second of the whole job."),
    "tokens_per_s": ("slipstream_tokens_per_second", "Tokens per second of the whole job."),
    "model_flops_per_s": ("slipstream_model_flops_per_second", "Achieved model FLOP/s of this rank."),
    "mfu": ("slipstream_mfu_ratio", "Model FLOPs utilisation (achieved / peak), 0..1."),
    "sync_compression_ratio": ("slipstream_comm_compression_ratio", "Uncompressed / sent gradient bytes."),
    "mem_rss_bytes": ("slipstream_memory_rss_bytes", "Process resident set size."),
    "cuda_peak_allocated_bytes": ("slipstream_cuda_memory_peak_allocated_bytes", "Peak CUDA memory allocated by the process so far (never reset)."),
    "cuda_peak_reserved_bytes": ("slipstream_cuda_memory_peak_reserved_bytes", "Peak CUDA memory reserved by the process so far (never reset)."),
    "straggler_slowdown": ("slipstream_straggler_slowdown_ratio", "Slowdown of the named straggler vs the median rank."),
}
_PHASES = ("data_wait", "forward", "backward", "comm_exposed", "optimizer", "checkpoint", "other")


class PrometheusSink:
    """Serves the latest record on ``http://ADDR:PORT/metrics`` (a daemon thread)."""

    def __init__(self, rank: int, port: int, addr: str = "127.0.0.1") -> None:
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            start_http_server,
        )

        self.rank = rank
        self.registry = CollectorRegistry()
        r = self.registry
        label = {"rank": str(rank)}
        self._steps = Counter("slipstream_steps_total", "Optimizer steps done.", ["rank"], registry=r).labels(**label)
        self._samples = Counter("slipstream_samples_total", "Samples processed by this rank.", ["rank"], registry=r).labels(**label)
        self._tokens = Counter("slipstream_tokens_total", "Tokens processed by this rank.", ["rank"], registry=r).labels(**label)
        self._bytes = Counter(
            "slipstream_comm_sent_bytes_total", "Gradient-synchronisation bytes sent by this rank.", ["rank"], registry=r
        ).labels(**label)
        self._gauges = {
            key: Gauge(name, doc, ["rank"], registry=r).labels(**label) for key, (name, doc) in _GAUGES.items()
        }
        phase = Gauge("slipstream_step_phase_seconds", "Seconds per step spent in each phase.", ["rank", "phase"], registry=r)
        self._phases = {p: phase.labels(rank=str(rank), phase=p) for p in _PHASES}
        self._straggler = Gauge(
            "slipstream_straggler_rank", "Rank named as persistent straggler, -1 when none.", ["rank"], registry=r
        ).labels(**label)
        self._straggler.set(-1)
        self._last_step = 0
        self._last_bytes = 0.0
        started = start_http_server(port, addr=addr, registry=r)
        self._server = started[0] if isinstance(started, tuple) else None
        self.addr = addr
        self.port = self._server.server_port if self._server is not None else port

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def write(self, record: dict[str, Any]) -> None:
        step = int(record.get("step", 0))
        if step > self._last_step:
            self._steps.inc(step - self._last_step)
            self._last_step = step
        if record.get("samples"):
            self._samples.inc(record["samples"])
        if record.get("tokens"):
            self._tokens.inc(record["tokens"])
        sent = record.get("sync_bytes_sent_total")
        if isinstance(sent, (int, float)) and sent > self._last_bytes:
            self._bytes.inc(sent - self._last_bytes)
            self._last_bytes = float(sent)
        for key, gauge in self._gauges.items():
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.set(value)
        for p, gauge in self._phases.items():
            value = record.get(f"{p}_s")
            if isinstance(value, (int, float)):
                gauge.set(value)
        if "straggler_rank" in record:
            sr = record["straggler_rank"]
            self._straggler.set(-1 if sr is None else sr)
            if sr is None:
                self._gauges["straggler_slowdown"].set(0.0)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["PrometheusSink"]
