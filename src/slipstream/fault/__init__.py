"""Failure detection: progress heartbeats, hang diagnosis (in process and from torch's flight recorder)."""

from .flight_recorder import (
    FlightRecorderVerdict,
    analyze_traces,
    configure_flight_recorder,
    diagnose_flight_recorder,
    read_traces,
)
from .progress import (
    CollectiveTimeout,
    ProgressReporter,
    diagnose_hang,
    is_collective_failure,
    read_progress_files,
    write_hang_report,
)

__all__ = [
    "CollectiveTimeout",
    "FlightRecorderVerdict",
    "ProgressReporter",
    "analyze_traces",
    "configure_flight_recorder",
    "diagnose_flight_recorder",
    "diagnose_hang",
    "is_collective_failure",
    "read_progress_files",
    "read_traces",
    "write_hang_report",
]
