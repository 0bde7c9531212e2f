"""The launcher's last lines: what the run did, and where it went.

``slipstream run`` prints them for every run, whatever the script prints: a user's own
script is otherwise never told where its metrics went (the example scripts used to print
these lines themselves; the README's script and zero-change runs printed neither). They
come from the run directory the launcher chose before any worker started
(:func:`slipstream.launch.api.with_run_dir`): the last records of rank 0's metrics.

Example::

    for line in summary_lines("/tmp/runs/20261207-010203", exit_code=0, elapsed_s=22.6):
        print(line)
    # slipstream run: done: 30 steps in 12.3 s of training (22.6 s in all), final loss 3.3333, 5012 tokens/s, 2 rank(s)
    # slipstream run: run directory /tmp/runs/20261207-010203 (see it with: slipstream report /tmp/runs/20261207-010203)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from ..errors import EXIT_OK


@dataclass(frozen=True)
class RunTotals:
    """What rank 0's metrics say about the last run in a run directory."""

    steps: int
    train_s: float
    """Seconds from the step recorder's start to its last record."""
    final_loss: float | None
    rate: float | None
    """Tokens (or, without tokens, samples) per second of the whole job."""
    rate_unit: str
    world_size: int | None


def read_totals(run_dir: str) -> RunTotals | None:
    """Rank 0's metrics in ``run_dir`` summed up; None when there are none (a script that
    does not call ``slipstream.accelerate()``, or a run that stopped before its first record).

    A run directory used again (``--run-dir`` kept across runs) holds earlier runs' records
    first: only the records after the last restart of the recorder's clock count.

    Example::

        read_totals("runs/20261207-010203").steps   # 30
    """
    records: list[dict] = []
    try:
        with open(os.path.join(run_dir, "metrics", "rank0.jsonl"), encoding="utf-8") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by a killed worker
                    continue
                if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                    continue
                if records and record.get("time_s", 0.0) < records[-1].get("time_s", 0.0):
                    records = []  # the recorder started again: a new run in the same directory
                records.append(record)
    except OSError:
        return None
    if not records:
        return None
    world_size = None
    try:
        with open(os.path.join(run_dir, "metrics", "run.json"), encoding="utf-8") as fh:
            world_size = json.load(fh).get("world_size")
    except (OSError, ValueError, AttributeError):
        pass
    last = records[-1]
    train_s = float(last.get("time_s") or 0.0)
    rate, unit = None, "tokens/s"
    for key, unit_name in (("tokens", "tokens/s"), ("samples", "samples/s")):
        total = sum(r.get(key) or 0 for r in records)
        if total and train_s > 0:  # every rank sees equal batches, as the recorder's own rates assume
            rate, unit = total * (world_size or 1) / train_s, unit_name
            break
    loss = last.get("loss")
    return RunTotals(steps=last["step"], train_s=train_s,
                     final_loss=loss if isinstance(loss, (int, float)) and math.isfinite(loss) else None,
                     rate=rate, rate_unit=unit, world_size=world_size if isinstance(world_size, int) else None)


def summary_lines(run_dir: str | None, exit_code: int, elapsed_s: float) -> list[str]:
    """The launcher's closing lines for a run that ended with ``exit_code``.

    0: one summary line, then the run directory. Otherwise the failure was reported
    already; the run directory alone follows (its metrics and flight-recorder dumps say
    what happened), when there is one.
    """
    totals = read_totals(run_dir) if run_dir else None
    lines: list[str] = []
    if exit_code == EXIT_OK:
        if totals is None:
            lines.append(f"slipstream run: done in {elapsed_s:.1f} s (the script recorded no Slipstream metrics)")
        else:
            parts = [f"{totals.steps} steps in {totals.train_s:.1f} s of training ({elapsed_s:.1f} s in all)"]
            if totals.final_loss is not None:
                parts.append(f"final loss {totals.final_loss:.4f}")
            if totals.rate is not None:
                parts.append(f"{totals.rate:.0f} {totals.rate_unit}")
            if totals.world_size is not None:
                parts.append(f"{totals.world_size} rank(s)")
            lines.append("slipstream run: done: " + ", ".join(parts))
    if run_dir and os.path.isdir(run_dir):
        if totals is not None:
            lines.append(f"slipstream run: run directory {run_dir} (see it with: slipstream report {run_dir})")
        else:
            lines.append(f"slipstream run: run directory {run_dir}")
    return lines
