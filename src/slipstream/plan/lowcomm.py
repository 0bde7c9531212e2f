"""``slipstream plan``'s low-communication rows: DiLoCo beside the per-step layouts, and when to use it.

The step model and the rule are the core's (:mod:`slipstream.network.lowcomm`, shared with
``auto``); this module applies them to a :class:`~.planner.PlanResult`:

* DiLoCo runs on the plain data-parallel layout only (``ddpN``: DDP replicas, no sharding,
  tensor or pipeline parallel; ``TrainConfig`` refuses the rest). Its compute is that of the
  fitting ``ddpN`` candidate with the shortest step without communication
  (``step - exposed comm - codec compute``: forward, backward, optimizer); its link is the one
  that layout's gradient all-reduce crosses (:func:`~.costmodel.group_link`). Each row is that
  step plus the outer all-reduces per step of one :data:`slipstream.network.lowcomm.SETTINGS` setting.
* Memory: the layout's, plus two fp32 copies of the parameters (the outer parameters and the
  outer momentum, docs/sync.md "Costs").
* The per-step side of the rule is the ranking's #1 (whatever its layout), at its own
  utilisation ``(step - exposed comm - codec compute) / step``.

DiLoCo rows are not ranked with the per-step layouts: they change the optimisation (a run may
need more steps for the same loss), so the time to train they show is at the same number of
steps.

Example::

    result = plan(load_user_model("examples/train_gpt.py:GPT"), gpus=2, gpu_type="cpu",
                  network="100mbit,40ms", gpus_per_node=1, global_batch=32, precision="fp32")
    low = low_comm(result)
    low.advice.recommendation.setting.label()      # 'diloco H=50'
    print(low.table(width=100))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .. import sync
from ..network.lowcomm import SETTINGS, DilocoEstimate, LowCommAdvice, advise, percent
from .costmodel import group_link
from .planner import Candidate, PlanResult, fit_columns, fmt_s
from .specs import GIB

OUTER_STATE_BYTES_PER_PARAM = 8
"""The outer parameters and the outer momentum, fp32 each: DiLoCo's memory on top of DDP's."""
MEASURED = "docs/sync.md, \"DiLoCo\""


def floor_s(c: Candidate) -> float:
    """The candidate's step with its data-parallel communication free: forward, backward, optimizer."""
    p = c.prediction
    return p.step_s - p.exposed_comm_s - p.codec_compute_s


def per_step_name(c: Candidate) -> str:
    """How the recommendation names a per-step row: ``#1 ddp2 powersgd``."""
    L = c.layout
    sync = f" {L.sync}" if L.dp_shard == 1 and L.dp_replicate > 1 else ""
    return f"#1 {L.label()}{sync}"


@dataclass(frozen=True)
class LowCommRow:
    estimate: DilocoEstimate
    time_to_train_s: float  # at the same number of steps as the per-step rows
    cost: float
    memory_bytes: float
    fits: bool


@dataclass(frozen=True)
class LowCommPlan:
    """DiLoCo on ``base`` (a ``ddpN`` candidate), priced against ``result.best``."""

    base: Candidate
    per_step: Candidate
    advice: LowCommAdvice
    rows: tuple[LowCommRow, ...]
    memory_limit_bytes: float

    @property
    def recommended(self) -> LowCommRow | None:
        r = self.advice.recommendation
        return next((row for row in self.rows if row.estimate is r), None) if r is not None else None

    def table(self, width: int | None = None):
        """A rich Table of the rows, at ``width`` columns as :meth:`PlanResult.table` (columns left
        out are named in the caption)."""
        from rich.table import Table

        L = self.base.layout
        t = Table(title=f"Low-communication sync (DiLoCo) on {L.label()}, {L.micro_batch} x {L.microbatches_per_step}: "
                        f"changes the optimisation, so not ranked above")
        columns = (("sync", "left"), ("step", "right"), ("outer comm/step", "right"), ("util", "right"),
                   ("vs #1", "right"), ("time to train", "right"), ("cost", "right"), ("mem/GPU", "right"))
        rows = []
        for r in self.rows:
            e = r.estimate
            mark = " *" if e is self.advice.recommendation else ""
            rows.append((e.setting.label() + mark, fmt_s(e.step_s), fmt_s(e.comm_step_s), f"{e.utilisation:.1%}",
                         f"{self.advice.speedup(e):.2f}x", fmt_s(r.time_to_train_s), f"${r.cost:,.0f}",
                         f"{r.memory_bytes / GIB:.1f}/{self.memory_limit_bytes / GIB:.0f} GiB"
                         + ("" if r.fits else " (no fit)")))
        keep, hidden = fit_columns([n for n, _ in columns], rows, width, ("cost", "mem/GPU", "time to train"))
        for j in keep:
            t.add_column(columns[j][0], justify=columns[j][1], no_wrap=True)
        for row in rows:
            t.add_row(*(row[j] for j in keep))
        caption = [f"{per_step_name(self.per_step)}: utilisation {percent(self.advice.per_step_utilisation)}; util = "
                   f"compute / step; the outer all-reduce is not overlapped (docs/plan.md, \"Low-communication "
                   f"mode\")"]
        if self.advice.recommendation is not None:
            caption.append("*: recommended (below)")
        if hidden:
            caption.append(f"not shown at {width} columns: {', '.join(hidden)} (--json has every figure)")
        t.caption = "\n".join(caption)
        return t

    def as_record(self, run: str | None = None) -> dict[str, Any]:
        """For ``--json``: the rows, the rule's figures and the recommendation with its command ``run``."""
        doc = self.advice.as_record()
        doc["layout"] = self.base.layout.label()
        doc["micro_batch"] = self.base.layout.micro_batch
        doc["per_step"] = {"layout": self.per_step.layout.label(), "sync": self.per_step.layout.sync,
                           "step_s": self.per_step.prediction.step_s,
                           "utilisation": self.advice.per_step_utilisation}
        for est, row in zip(doc["estimates"], self.rows, strict=True):
            est.update(time_to_train_s=row.time_to_train_s, cost=row.cost, memory_gib=row.memory_bytes / GIB,
                       fits=row.fits)
        if doc["recommendation"] is not None:
            doc["recommendation"]["run"] = run
            doc["recommendation"]["line"] = self.advice.line(per_step_name(self.per_step))
            doc["recommendation"]["quality"] = MEASURED
        return doc


def low_comm(result: PlanResult) -> LowCommPlan | None:
    """DiLoCo's rows for ``result`` (module docstring); None where no plain data-parallel layout of
    two or more replicas fits."""
    ddp = [c for c in result.candidates
           if c.layout.dp_replicate == result.gpus > 1 and c.layout.dp_shard == c.layout.tp == c.layout.pp == 1]
    if not ddp:
        return None
    # On a tie, DDP's own reducer (nothing compressed).
    plain = sync.SyncKind.REDUCER
    base = min(ddp, key=lambda c: (floor_s(c), sync.describe(c.layout.sync).kind is not plain, c.time_to_train_s))
    L = base.layout
    link, _ = group_link(L.dp_replicate, L.tp, result.gpus_per_node, result.gpu, result.network)
    best = result.best
    advice = advise(floor_s(base), best.prediction.step_s, int(result.model.params), 4, link, L.dp_replicate,
                    SETTINGS, per_step_compute_s=floor_s(best))
    steps = result.total_samples / L.global_batch
    memory = base.prediction.memory_bytes + OUTER_STATE_BYTES_PER_PARAM * result.model.params
    limit = base.prediction.memory_limit_bytes
    if advice.recommendation is not None and memory > limit:
        advice = dataclasses.replace(advice, recommendation=None, reason=(
            f"{advice.reason}; but not recommended: with DiLoCo's outer state {L.label()} needs "
            f"{memory / GIB:.1f} GiB per device, above {limit / GIB:.1f} GiB"))
    rows = tuple(LowCommRow(e, steps * e.step_s, steps * e.step_s / 3600 * result.gpus * result.price_per_gpu_hour,
                            memory, memory <= limit) for e in advice.estimates)
    return LowCommPlan(base, best, advice, rows, limit)


__all__ = ["MEASURED", "OUTER_STATE_BYTES_PER_PARAM", "LowCommPlan", "LowCommRow", "floor_s", "low_comm",
           "per_step_name"]
