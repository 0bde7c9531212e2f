"""Per-step metrics: a recorder with a step profiler that feeds pluggable sinks.

Sinks: console (rank 0), JSONL per rank, TensorBoard, Prometheus, the experiment
trackers W&B and MLflow (rank 0, ``log_to``), the user's own (``accelerate(sinks=...)``);
a Chrome-trace timeline; straggler detection at log steps. ``slipstream report RUN_DIR`` turns
a run directory into one HTML page (see :mod:`slipstream.report`).
"""

from .profiler import PHASES, StepProfiler
from .recorder import StepRecorder
from .sinks import ConsoleSink, JsonlSink, Sink
from .straggler import StragglerDetector, Verdict

__all__ = ["PHASES", "ConsoleSink", "JsonlSink", "Sink", "StepProfiler", "StepRecorder", "StragglerDetector", "Verdict"]
