"""``slipstream bench``: run a user's own script under several sync strategies, side by side."""

from .cli import BenchResult, bench, parse_metrics

__all__ = ["BenchResult", "bench", "parse_metrics"]
