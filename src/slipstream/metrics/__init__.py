"""Per-step metrics: a recorder that feeds pluggable sinks (console, JSONL)."""

from .recorder import StepRecorder
from .sinks import ConsoleSink, JsonlSink, Sink

__all__ = ["ConsoleSink", "JsonlSink", "Sink", "StepRecorder"]
