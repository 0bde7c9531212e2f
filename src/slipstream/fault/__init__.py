"""Failure detection: progress heartbeats, hang diagnosis, preemption deadline."""

from .progress import CollectiveTimeout, ProgressReporter, diagnose_hang, is_collective_failure

__all__ = ["CollectiveTimeout", "ProgressReporter", "diagnose_hang", "is_collective_failure"]
