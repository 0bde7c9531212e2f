"""Reading a run directory: per-rank JSONL records, run info, hang diagnosis, timeline.

Layout read (all optional except at least one metrics file)::

    RUN_DIR/metrics/rank<R>.jsonl     one record per log step (StepRecorder)
    RUN_DIR/metrics/run.json          world size, parameters, peak FLOP/s, config
    RUN_DIR/timeline/rank<R>.json     Chrome trace spans (timeline=True)
    RUN_DIR/hang.json, hang.txt       written when a collective timed out

Example::

    run = load_run("runs/x")
    run.ranks[0][-1]["loss"], run.summary()["final_loss"]
"""

from __future__ import annotations

import glob
import json
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError

PHASE_KEYS = ("data_wait_s", "forward_s", "backward_s", "comm_exposed_s", "optimizer_s", "checkpoint_s", "other_s")


@dataclass
class Run:
    run_dir: str
    ranks: dict[int, list[dict[str, Any]]]
    info: dict[str, Any] = field(default_factory=dict)
    hang_text: str | None = None
    hang: dict[str, Any] | None = None
    bad_lines: int = 0

    @property
    def world_size(self) -> int:
        return int(self.info.get("world_size") or (max(self.ranks) + 1 if self.ranks else 0))

    def series(self, key: str, rank: int = 0) -> tuple[list[int], list[float]]:
        """(steps, values) of a numeric field for one rank, skipping missing values."""
        xs, ys = [], []
        for rec in self.ranks.get(rank, []):
            v = rec.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                xs.append(int(rec["step"]))
                ys.append(float(v))
        return xs, ys

    def steady(self, key: str, rank: int = 0) -> float | None:
        """Median of a field over the log windows after the first (warm-up) one."""
        _, ys = self.series(key, rank)
        if len(ys) > 1:
            ys = ys[1:]
        return statistics.median(ys) if ys else None

    def phase_means(self, rank: int) -> dict[str, float]:
        return {k: self.steady(k, rank) or 0.0 for k in PHASE_KEYS}

    def last(self, key: str, rank: int = 0) -> Any:
        for rec in reversed(self.ranks.get(rank, [])):
            if rec.get(key) is not None:
                return rec[key]
        return None

    def summary(self) -> dict[str, Any]:
        """The numbers of the report's summary table."""
        r0 = self.ranks.get(0) or next(iter(self.ranks.values()))
        out: dict[str, Any] = {
            "ranks": self.world_size,
            "steps": max(int(rec["step"]) for recs in self.ranks.values() for rec in recs),
            "elapsed_s": max(float(rec.get("time_s") or 0.0) for recs in self.ranks.values() for rec in recs),
            "final_loss": self.last("loss"),
            "samples_per_s": self.steady("samples_per_s"),
            "tokens_per_s": self.steady("tokens_per_s"),
            "step_time_s": self.steady("step_time_s"),
            "mfu": self.steady("mfu"),
            "model_flops_per_s": self.steady("model_flops_per_s"),
            "mem_rss_bytes_max": max((rec.get("mem_rss_bytes") or 0 for recs in self.ranks.values() for rec in recs), default=0) or None,
            "cuda_peak_allocated_bytes": max((rec.get("cuda_peak_allocated_bytes") or 0 for recs in self.ranks.values() for rec in recs), default=0) or None,
            "cuda_peak_reserved_bytes": max((rec.get("cuda_peak_reserved_bytes") or 0 for recs in self.ranks.values() for rec in recs), default=0) or None,
            "sync_strategy": self.last("sync_strategy"),
            # auto's choice as it printed it at decision time (sync/auto.py decision_line), its
            # verdict after timing the plan, and the codec counts older runs recorded instead
            "sync_decision_line": self.last("sync_decision_line"),
            "sync_verification": self.last("sync_verification"),
            "sync_decision": self.last("sync_decision"),
            "sync_bytes_sent_total": sum(float(self.last("sync_bytes_sent_total", r) or 0.0) for r in self.ranks) or None,
            "sync_compression_ratio": self.last("sync_compression_ratio"),
            # auto's DiLoCo recommendation (sync/auto.py), where its measured link made per-step sync lose widely
            "sync_recommendation": self.last("sync_recommendation"),
            "straggler": self.last("straggler_message") if r0 and r0[-1].get("straggler_rank") is not None else None,
            "hang": (self.hang_text or "").strip() or None,
        }
        step = out["step_time_s"]
        if step:
            phases = self.phase_means(0)
            out["phase_share"] = {k[:-2]: v / step for k, v in phases.items()}
        return out


def _read_jsonl(path: str) -> tuple[list[dict[str, Any]], int]:
    records, bad = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad += 1  # a line cut short by a crash
                continue
            if isinstance(rec, dict) and "step" in rec:
                records.append(rec)
    # A restarted run appends: keep the latest record of each step, in step order.
    by_step: dict[int, dict[str, Any]] = {}
    for rec in records:
        by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)], bad


def load_run(run_dir: str) -> Run:
    """Read a run directory; raises UsageError when it holds no metrics."""
    if not os.path.isdir(run_dir):
        raise UsageError(f"run directory {run_dir!r} does not exist")
    ranks: dict[int, list[dict[str, Any]]] = {}
    bad = 0
    for path in glob.glob(os.path.join(run_dir, "metrics", "rank*.jsonl")):
        m = re.search(r"rank(\d+)\.jsonl$", path)
        if not m:
            continue
        records, b = _read_jsonl(path)
        bad += b
        if records:
            ranks[int(m.group(1))] = records
    if not ranks:
        raise UsageError(f"no metrics in {run_dir!r}: expected {os.path.join(run_dir, 'metrics', 'rank<R>.jsonl')}")
    info: dict[str, Any] = {}
    info_path = os.path.join(run_dir, "metrics", "run.json")
    if os.path.exists(info_path):
        try:
            with open(info_path, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, json.JSONDecodeError):
            info = {}
    hang_text = hang = None
    if os.path.exists(os.path.join(run_dir, "hang.txt")):
        with open(os.path.join(run_dir, "hang.txt"), encoding="utf-8", errors="replace") as f:
            hang_text = f.read()
    if os.path.exists(os.path.join(run_dir, "hang.json")):
        try:
            with open(os.path.join(run_dir, "hang.json"), encoding="utf-8") as f:
                hang = json.load(f)
        except (OSError, json.JSONDecodeError):
            hang = None
        if hang_text is None and isinstance(hang, dict):
            hang_text = str(hang.get("culprit") or json.dumps(hang)[:2000])
    return Run(run_dir=run_dir, ranks=dict(sorted(ranks.items())), info=info, hang_text=hang_text, hang=hang, bad_lines=bad)


__all__ = ["PHASE_KEYS", "Run", "load_run"]
