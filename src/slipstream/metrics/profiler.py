"""Step profiler: where each step's time went, per rank, without stalling the device.

Phases of one optimizer step (all in seconds, per step, averaged over a log window):

``data_wait_s``
    host time between the end of the previous Slipstream call (a backward,
    an optimizer step) and the next forward: the training loop fetching and
    moving its batch.
``forward_s``
    the wrapped model's forward.
``backward_s``
    backward *compute*: from the start of ``run.backward`` to the moment the
    last parameter gradient was accumulated.
``comm_exposed_s``
    the rest of ``run.backward``: waiting for gradient synchronisation that
    did not overlap with compute (DDP's reducer blocks at the end of backward
    until every bucket is reduced).
``optimizer_s``
    clipping, ``optimizer.step()``, ``zero_grad`` and the scheduler.
``checkpoint_s``
    whatever runs inside ``recorder.timed("checkpoint")``.
``other_s``
    the step time not covered by the phases above (user code, logging).
``busy_s``
    data_wait + forward + backward + optimizer: the time a rank spends outside
    gradient synchronisation. On a healthy job it is the same on every rank;
    the straggler detector compares it across ranks.

How it is measured. On CPU every boundary is ``time.perf_counter()``: no
device to synchronise. On CUDA every device phase boundary records a
``torch.cuda.Event`` (non-blocking); the events are read back once per log
window (``flush``), after the one synchronisation the recorder already does
for the loss. The "first/last gradient ready" points come from
``register_post_accumulate_grad_hook``: the first backward hooks every
trainable parameter once to learn the order in which gradients arrive, then
only the first and last to arrive and a few evenly spaced between stay hooked
(at most ``MAX_GRAD_HOOKS``), so a backward costs a handful of Python calls
and CUDA event records instead of one per parameter (a GPT has hundreds).

MFU (model FLOPs utilisation) = achieved model FLOP/s / peak FLOP/s of the
device. Model FLOPs of a training step are ``6 * n_params * tokens`` when the
model consumes integer token ids (the Kaplan et al. approximation for a
transformer: 2 for forward, 4 for backward, attention's ``12 * layers * d *
seq`` term ignored), or ``flops_per_sample * samples`` when the user gives
``flops_per_sample`` (training FLOPs, forward + backward, of one sample).
Peak comes from ``peak_flops`` or, on known GPUs, from a small table by the
math actually in use: bf16/fp16 tensor cores, TF32 tensor cores for fp32 when
TF32 matmuls are allowed, else the fp32 CUDA-core rate (TF32 is off by
default in torch). The recorder re-reads the TF32 switch at every log step, so
turning it on after ``accelerate()`` is seen.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

# Marks are (host seconds, CUDA event or None): the clocks are shared with the sync engine.
from ..process.timing import CudaClock, HostClock, duration_s

# Parameters hooked after the first backward: the first and last gradient to
# arrive bound the backward compute and the gradient sync; the ones between only
# keep the "last" point close when the arrival order varies between steps
# (control flow, unused parameters).
MAX_GRAD_HOOKS = 8

PHASES = ("data_wait", "forward", "backward", "comm_exposed", "optimizer", "checkpoint")
BUSY_PHASES = ("data_wait", "forward", "backward", "optimizer")
COMM_PHASES = frozenset({"comm_exposed", "grad_sync", "straggler_gather"})


@dataclass(frozen=True)
class DevicePeaks:
    """Dense peak FLOP/s of one GPU per math mode (vendors' data sheets, SXM parts, no sparsity).

    ``fp32`` is the CUDA-core rate an fp32 matmul gets with TF32 off; ``tf32``
    the tensor-core rate when TF32 is allowed (None: the GPU has no TF32);
    ``bf16``/``fp16`` the 16-bit tensor-core rates (None: no such tensor cores).
    """

    fp32: float
    tf32: float | None
    bf16: float | None
    fp16: float


# Matched in order against the upper-cased device name: variants before the base name.
_PEAK_FLOPS: tuple[tuple[str, DevicePeaks], ...] = (
    ("H200", DevicePeaks(fp32=67e12, tf32=494.7e12, bf16=989.4e12, fp16=989.4e12)),
    ("H100 PCIE", DevicePeaks(fp32=51e12, tf32=378e12, bf16=756e12, fp16=756e12)),
    ("H100 NVL", DevicePeaks(fp32=60e12, tf32=417.5e12, bf16=835e12, fp16=835e12)),
    ("H100", DevicePeaks(fp32=67e12, tf32=494.7e12, bf16=989.4e12, fp16=989.4e12)),
    ("A100", DevicePeaks(fp32=19.5e12, tf32=156e12, bf16=312e12, fp16=312e12)),
    ("L40S", DevicePeaks(fp32=91.6e12, tf32=183e12, bf16=362e12, fp16=362e12)),
    ("A10G", DevicePeaks(fp32=31.2e12, tf32=35e12, bf16=70e12, fp16=70e12)),
    ("L4", DevicePeaks(fp32=30.3e12, tf32=60e12, bf16=121e12, fp16=121e12)),
    ("V100", DevicePeaks(fp32=15.7e12, tf32=None, bf16=None, fp16=125e12)),
)


def tf32_matmul_allowed() -> bool:
    """True when fp32 matmuls on CUDA may run as TF32 (the setting in effect now).

    Reads torch's new switch (``torch.backends.cuda.matmul.fp32_precision``,
    falling back to ``torch.backends.fp32_precision`` when it says "none"),
    which the legacy ``allow_tf32`` and ``set_float32_matmul_precision`` also
    set; reading ``allow_tf32`` itself raises in torch 2.13 once the new API
    was used. Off by default.

    Example::

        torch.set_float32_matmul_precision("high")
        tf32_matmul_allowed()   # True
    """
    matmul = torch.backends.cuda.matmul
    try:
        mode = getattr(matmul, "fp32_precision")
        if mode == "none":
            mode = getattr(torch.backends, "fp32_precision", "none")
        return mode == "tf32"
    except AttributeError:  # a torch without the new API
        return bool(matmul.allow_tf32)


def peak_flops_for(device_name: str, precision: str, tf32: bool) -> float | None:
    """Dense peak FLOP/s of the GPU named ``device_name`` for the math actually used, else None.

    ``precision`` is the training precision (fp32, bf16, fp16); for fp32,
    ``tf32`` says whether matmuls run as TF32 (see :func:`tf32_matmul_allowed`):
    with TF32 off an fp32 matmul gets the CUDA-core rate, about 7x (H100)
    below the TF32 tensor-core rate, and MFU against the TF32 peak would read 7x too low.

    Example::

        peak_flops_for("NVIDIA H100 80GB HBM3", "fp32", tf32=False)   # 67e12
        peak_flops_for("NVIDIA H100 80GB HBM3", "fp32", tf32=True)    # 494.7e12
        peak_flops_for("NVIDIA H100 80GB HBM3", "bf16", tf32=False)   # 989.4e12
    """
    name = device_name.upper()
    for key, peaks in _PEAK_FLOPS:
        if key in name:
            if precision == "bf16":
                return peaks.bf16
            if precision == "fp16":
                return peaks.fp16
            return peaks.tf32 if tf32 and peaks.tf32 is not None else peaks.fp32
    return None


def default_peak_flops(device: torch.device, precision: str = "fp32") -> float | None:
    """Peak FLOP/s of ``device`` for ``precision`` and the TF32 setting now in effect,
    when it is a GPU we know, else None.

    Example::

        default_peak_flops(torch.device("cpu"))   # None: give peak_flops yourself
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for(torch.cuda.get_device_name(device), precision, tf32_matmul_allowed())


def process_rss_bytes() -> int | None:
    """Resident set size of this process in bytes (Linux /proc, else psutil, else None)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - memory is best effort
        return None


@dataclass
class Span:
    """A resolved interval: absolute start in host perf_counter seconds, duration in seconds."""

    phase: str
    start_s: float
    dur_s: float
    step: int


@dataclass
class _Row:
    """The raw marks of one optimizer step, resolved at flush time."""

    step: int
    spans: list[tuple[str, tuple[float, Any], tuple[float, Any]]] = field(default_factory=list)


class StepProfiler:
    """Phase timing of every step; resolved once per log window.

    Used through :class:`~slipstream.metrics.StepRecorder` (``begin``/``end``/
    ``timed``); on its own::

        prof = StepProfiler()
        t = prof.begin("forward"); y = model(x); prof.end("forward", t)
        prof.end_step(1)
        rows = prof.resolve()      # [{"forward_s": ...}], spans in prof.spans
    """

    def __init__(self, clock: HostClock | CudaClock | None = None, communicates: bool = True) -> None:
        self.clock = clock or HostClock()
        # False at world size 1: nothing is synchronised, so the time from the last gradient to
        # the end of backward() is backward work (autograd's tail), not exposed communication (a
        # one-process run read "comm 58%").
        self.communicates = communicates
        self._rows: list[_Row] = []
        self._row = _Row(step=1)
        self._last_end_host: float | None = None
        self._in_backward = False
        self._grad_first: tuple[float, Any] | None = None
        self._grad_last: tuple[float, Any] | None = None
        self._grad_last_event: Any = None
        self._hooks: list[Any] = []
        self._params: list[torch.nn.Parameter] = []
        self._arrival: list[torch.nn.Parameter] | None = None  # filled during the calibrating backward
        self.spans: list[Span] = []  # filled by resolve(), for the timeline

    # --- hot path ---------------------------------------------------------------------
    def begin(self, phase: str) -> tuple[float, Any]:
        mark = self.clock.mark()
        if phase == "forward" and self._last_end_host is not None:
            # Host gap since the last Slipstream call: the loop fetched its data.
            self._row.spans.append(("data_wait", (self._last_end_host, None), (mark[0], None)))
        elif phase == "backward":
            self._in_backward = True
            self._grad_first = None
            self._grad_last = None
            self._grad_last_event = self.clock.new_event()
        return mark

    def end(self, phase: str, start: tuple[float, Any]) -> None:
        mark = self.clock.mark()
        if phase == "backward":
            self._in_backward = False
            if self._arrival:
                self._narrow_hooks()
            last = self._grad_last
            if last is not None and self.communicates:
                self._row.spans.append(("backward", start, last))
                self._row.spans.append(("comm_exposed", last, mark))
                self._row.spans.append(("grad_sync", self._grad_first, mark))
            else:
                self._row.spans.append(("backward", start, mark))
        else:
            self._row.spans.append((phase, start, mark))
        self._last_end_host = mark[0]

    def grad_ready(self, *_: Any) -> None:
        """Called after each parameter's gradient is accumulated (post-accumulate hook)."""
        if not self._in_backward:
            return
        now = time.perf_counter()
        event = self._grad_last_event
        if self._grad_first is None:
            self._grad_first = self.clock.mark()
            self._grad_last = (now, event)
        else:
            self._grad_last = (now, event)
        if event is not None:
            self.clock.record(event)  # re-recorded: the last one wins

    def end_step(self, step: int) -> None:
        """Close the current optimizer step (the next one starts now)."""
        self._rows.append(self._row)
        self._row = _Row(step=step + 1)
        self._last_end_host = time.perf_counter()

    def touch(self) -> None:
        """Restart the data-wait clock now (after work that is not the loop's own)."""
        self._last_end_host = time.perf_counter()

    def add_span(self, phase: str, start: tuple[float, Any], end: tuple[float, Any]) -> None:
        """Record a span that is not a step phase (e.g. the straggler gather) for the timeline."""
        self._row.spans.append((phase, start, end))

    # --- instrumentation -----------------------------------------------------------------
    def install(self, params: Iterable[torch.nn.Parameter]) -> int:
        """Hook the trainable parameters' gradient accumulation; returns how many are hooked.

        All of them until the first backward ends, which records the order the
        gradients arrive in; then at most ``MAX_GRAD_HOOKS`` (see
        :meth:`hook_count`).
        """
        self.remove()
        self._params = [p for p in params if p.requires_grad]
        if len(self._params) <= MAX_GRAD_HOOKS:
            self._hook(self._params, self.grad_ready)
        else:
            self._arrival = []
            self._hook(self._params, self._grad_ready_calibrating)
        return len(self._hooks)

    @property
    def hook_count(self) -> int:
        """Parameters hooked now (every backward runs this many hook calls)."""
        return len(self._hooks)

    def _hook(self, params: Iterable[torch.nn.Parameter], fn: Any) -> None:
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(fn))

    def _grad_ready_calibrating(self, param: torch.Tensor) -> None:
        if self._in_backward and self._arrival is not None:
            self._arrival.append(param)
        self.grad_ready()

    def _narrow_hooks(self) -> None:
        """After the calibrating backward: keep the first and last gradient to arrive, and
        evenly spaced ones between, up to MAX_GRAD_HOOKS."""
        seen: set[int] = set()
        order = []
        for p in self._arrival or []:
            if id(p) not in seen:
                seen.add(id(p))
                order.append(p)
        if self._arrival and self._arrival[-1] is not order[-1]:
            # Accumulated twice (reentrant checkpointing): it also arrived last.
            order.remove(self._arrival[-1])
            order.append(self._arrival[-1])
        self._arrival = None
        n = len(order)
        picks = sorted({round(i * (n - 1) / (MAX_GRAD_HOOKS - 1)) for i in range(MAX_GRAD_HOOKS)}) if n > 1 else [0]
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._hook([order[i] for i in picks if i < n], self.grad_ready)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._arrival = None

    # --- log time ------------------------------------------------------------------------
    def resolve(self) -> list[dict[str, float]]:
        """Per-step phase sums of the closed steps since the last call (reads device events).

        Also fills ``self.spans`` (absolute intervals) for the timeline.
        """
        rows, self._rows = self._rows, []
        extra = self._row.spans
        self.clock.synchronize(m for r in rows for _, a, b in r.spans for m in (a, b))
        self.spans = []
        out: list[dict[str, float]] = []
        for row in rows:
            sums = dict.fromkeys(PHASES, 0.0)
            anchor: tuple[float, Any] | None = None
            for phase, a, b in row.spans:
                dur = duration_s(a, b)
                if phase in sums:
                    sums[phase] += dur
                start = a[0]
                if a[1] is not None:
                    # Device time: place the span by its offset from the row's first event.
                    if anchor is None:
                        anchor = a
                    start = anchor[0] + anchor[1].elapsed_time(a[1]) / 1e3
                self.spans.append(Span(phase, start, dur, row.step))
            out.append(sums)
        # Spans recorded after the last closed step (the gather at flush) stay for next time.
        self._row.spans = extra
        return out


def window_means(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each phase over the rows, keyed ``<phase>_s``, plus ``busy_s``."""
    if not rows:
        return {}
    n = len(rows)
    out = {f"{p}_s": sum(r[p] for r in rows) / n for p in PHASES}
    out["busy_s"] = sum(out[f"{p}_s"] for p in BUSY_PHASES)
    return out


def model_flops(
    samples: int, tokens: int, n_params: int, flops_per_sample: float | None
) -> tuple[float | None, str | None]:
    """Training FLOPs of a window and the formula used (None when unknown).

    Example::

        model_flops(samples=8, tokens=8 * 128, n_params=1_000_000, flops_per_sample=None)
        # (6 * 1e6 * 1024, "6*params*tokens")
    """
    if flops_per_sample is not None:
        return float(flops_per_sample) * samples, "flops_per_sample*samples"
    if tokens and n_params:
        return 6.0 * n_params * tokens, "6*params*tokens"
    return None, None


__all__ = [
    "BUSY_PHASES",
    "PHASES",
    "CudaClock",
    "DevicePeaks",
    "HostClock",
    "MAX_GRAD_HOOKS",
    "Span",
    "StepProfiler",
    "default_peak_flops",
    "model_flops",
    "peak_flops_for",
    "process_rss_bytes",
    "tf32_matmul_allowed",
    "window_means",
]
