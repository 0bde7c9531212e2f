"""``python -m slipstream.bench.overhead [--width W --depth D --batch B --steps N]``: the flags
of the profiler-overhead benchmark, as an :class:`~slipstream.bench.overhead.OverheadRun`."""

from __future__ import annotations

import argparse

from . import OverheadRun, compare


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, run :func:`~slipstream.bench.overhead.compare` and print its report on rank 0; returns 0.

    Example::

        main(["--width", "256", "--depth", "48", "--steps", "100"])
    """
    defaults = OverheadRun()
    ap = argparse.ArgumentParser(prog="python -m slipstream.bench.overhead",
                                 description="Measure what the step profiler costs, two ways.")
    ap.add_argument("--width", type=int, default=defaults.width)
    ap.add_argument("--depth", type=int, default=defaults.depth)
    ap.add_argument("--batch", type=int, default=defaults.batch)
    ap.add_argument("--steps", type=int, default=defaults.steps, help="steps of each configuration")
    ap.add_argument("--log-every-steps", type=int, default=defaults.log_every_steps)
    args = ap.parse_args(argv)
    report = compare(OverheadRun(width=args.width, depth=args.depth, batch=args.batch, steps=args.steps,
                                 log_every_steps=args.log_every_steps))
    if report is not None:  # rank 0
        print(report)
    return 0
