"""The low-communication mode (``--sync diloco``): its step model, and when to recommend it.

A core module with no dependency but the link model (no torch): ``slipstream plan``
(:mod:`slipstream.plan.lowcomm`) and ``auto``'s decision (:mod:`slipstream.sync.auto`)
share it, so both recommend DiLoCo by one rule from one formula.

Under ``--sync diloco`` (docs/sync.md, "DiLoCo") a replica sends nothing for H
(``inner_steps``) optimizer steps, then all-reduces its parameter change once. With
F ``fragments`` the parameters are split in F parts and one part goes every H/F steps.
Per optimizer step, with P parameters, w bytes per value on the wire (the parameters'
width, 2 with ``outer_codec`` bf16/fp16) and n replicas on ``link``::

    outer_s     = link.allreduce_s(P / F * w, n)    one outer all-reduce: 2(n-1) hops + 2(n-1)/n P w / F / bw
    exposed_s   = max(0, outer_s - tau * compute_s)  tau = overlap_steps: hidden behind tau steps (0: blocking)
    comm_step_s = exposed_s / (H / F)                F of them every H steps
    step_s      = compute_s + comm_step_s
    utilisation = compute_s / step_s

``compute_s`` is the step with no communication (forward, backward, optimizer). By default
(``overlap_steps`` 0) the outer step blocks its step, so its all-reduce is added whole;
fragments spread the bytes but pay the latency F times as often, so without overlap a
fragments row is never faster than the same H and codec without fragments. With
``overlap_steps`` tau the all-reduce runs while the replica trains tau more steps, and only
what outlasts them is exposed (the model counts no slowdown of that compute by the
transfer, which on a CPU shares its cores). Left out, as small against the all-reduce on a slow link:
the outer optimizer's own pass over the parameters and the buffers' all-reduce at the end
of a period.

The rule (:func:`advise`): recommend DiLoCo when the best per-step strategy's predicted
utilisation is below :data:`LOW_UTILISATION` (50 %: communication takes more of the step
than compute) and a DiLoCo setting predicts at least :data:`MIN_SPEEDUP` (1.5x) its
throughput. The setting named is the one that changes the optimisation least (smallest H,
then no fragments, then no codec) whose utilisation reaches :data:`TARGET_UTILISATION`
(80 %), else the fastest.

Example::

    link = Link(12.5e6, 0.04, 0.8)                     # 100 Mbit/s, 40 ms a ring step, 80 % achieved
    est = estimate(0.078, 437_760, 4, link, 2, DilocoSetting(inner_steps=50))   # the 0.44M GPT
    est.comm_step_s, est.utilisation                   # 0.0052 s, 0.94
    advice = advise(0.078, 0.242, 437_760, 4, link, 2)
    advice.recommendation.setting.label()              # 'diloco H=50'
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ConfigError
from .link import Link

LOW_UTILISATION = 0.5
"""Recommend only when the best per-step strategy's utilisation is below this: its
communication exposed is longer than its compute. The DiLoCo measurement in docs/sync.md
(100 Mbit/s, 40 ms) is at 45-50 % (all-reduce took 50-55 % of each step), where DiLoCo
halved the loop."""
MIN_SPEEDUP = 1.5
"""...and DiLoCo predicts at least this throughput against it. DiLoCo costs quality (+1.8-3.9 %
held-out loss at equal steps on the GPT example, BENCHMARKS.md), so it has to buy a gain well outside the
planner's error (its step ranges are +-10-15 % on the emulated cluster, docs/plan.md)."""
TARGET_UTILISATION = 0.8
"""The H named: the smallest whose predicted utilisation reaches this. A larger H changes the
optimisation more (fewer outer steps) for at most the remaining 20 % of throughput."""
CODEC_WIDTHS = {"none": None, "bf16": 2, "fp16": 2}
"""Bytes per value of the outer all-reduce per ``outer_codec`` (None: the parameters' own)."""


@dataclass(frozen=True)
class DilocoSetting:
    """The ``--sync-options`` of one DiLoCo setting (names as :class:`slipstream.sync.options.SyncOptions`).

    Example::

        DilocoSetting(50, 5, "bf16").label()          # 'diloco H=50 F=5 bf16'
        DilocoSetting(50).sync_options_json()         # '{"inner_steps": 50}'
    """

    inner_steps: int = 50
    fragments: int = 1
    outer_codec: str = "none"
    overlap_steps: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.overlap_steps < self.inner_steps:
            raise ConfigError(f"diloco: overlap_steps must be in [0, inner_steps({self.inner_steps})), "
                              f"got {self.overlap_steps}")
        if self.inner_steps < 1 or not 1 <= self.fragments <= self.inner_steps:
            raise ConfigError(f"diloco: need inner_steps >= 1 and 1 <= fragments <= inner_steps, got "
                              f"inner_steps={self.inner_steps}, fragments={self.fragments}")
        if self.outer_codec not in CODEC_WIDTHS:
            raise ConfigError(f"diloco: outer_codec must be one of {', '.join(CODEC_WIDTHS)}, got {self.outer_codec!r}")

    def label(self) -> str:
        frag = f" F={self.fragments}" if self.fragments > 1 else ""
        codec = f" {self.outer_codec}" if self.outer_codec != "none" else ""
        overlap = f" tau={self.overlap_steps}" if self.overlap_steps else ""
        return f"diloco H={self.inner_steps}{frag}{codec}{overlap}"

    def sync_options(self) -> dict[str, int | str]:
        """The options that differ from the defaults, ``inner_steps`` always."""
        out: dict[str, int | str] = {"inner_steps": self.inner_steps}
        if self.fragments > 1:
            out["fragments"] = self.fragments
        if self.outer_codec != "none":
            out["outer_codec"] = self.outer_codec
        if self.overlap_steps:
            out["overlap_steps"] = self.overlap_steps
        return out

    def sync_options_json(self) -> str:
        return json.dumps(self.sync_options())

    def run_flags(self) -> list[str]:
        """``slipstream run`` flags (unquoted words)."""
        return ["--sync", "diloco", "--sync-options", self.sync_options_json()]

    @property
    def order(self) -> tuple[int, int, bool]:
        """How far from synchronous training: smaller H first, then fewer fragments, then no codec."""
        return (self.inner_steps, self.fragments, self.outer_codec != "none")


SETTINGS = (DilocoSetting(10), DilocoSetting(50), DilocoSetting(100), DilocoSetting(50, 5, "bf16"))
"""The settings ``slipstream plan`` and ``auto`` price: H of 10, 50 (the default) and 100, and
the streaming variant with a 16-bit outer all-reduce."""


@dataclass(frozen=True)
class DilocoEstimate:
    """One setting's predicted step (module docstring); seconds per optimizer step."""

    setting: DilocoSetting
    compute_s: float
    outer_s: float  # one outer all-reduce (one fragment)
    comm_step_s: float  # outer all-reduces per optimizer step, amortised
    step_s: float

    @property
    def utilisation(self) -> float:
        return self.compute_s / self.step_s if self.step_s > 0 else 1.0

    def as_record(self, per_step_s: float | None = None) -> dict:
        out = {"setting": self.setting.label(), "sync_options": self.setting.sync_options(),
               "step_s": self.step_s, "compute_s": self.compute_s, "outer_allreduce_s": self.outer_s,
               "comm_per_step_s": self.comm_step_s, "utilisation": self.utilisation}
        if per_step_s:
            out["speedup"] = per_step_s / self.step_s
        return out


def percent(x: float) -> str:
    """A utilisation as the line shows it: whole percents, one decimal below 10 %, two below 1 %.

    >>> percent(0.376), percent(0.042), percent(0.0002)
    ('38%', '4.2%', '0.02%')
    """
    return f"{x:.0%}" if x >= 0.1 else f"{x:.1%}" if x >= 0.01 else f"{x:.2%}"


def outer_bytes(numel: int, itemsize: int, setting: DilocoSetting) -> float:
    """Bytes one outer all-reduce takes in: 1/F of the parameters at the codec's width.

    >>> outer_bytes(1_000_000, 4, DilocoSetting(50)), outer_bytes(1_000_000, 4, DilocoSetting(50, 5, "bf16"))
    (4000000.0, 400000.0)
    """
    width = CODEC_WIDTHS[setting.outer_codec] or itemsize
    return numel / setting.fragments * min(width, itemsize)


def estimate(compute_s: float, numel: int, itemsize: int, link: Link, ranks: int,
             setting: DilocoSetting) -> DilocoEstimate:
    """The step of ``setting`` for a model of ``numel`` parameters of ``itemsize`` bytes over
    ``ranks`` replicas on ``link`` (a measured :class:`~slipstream.network.link.Link` or one from a network
    SPEC), with ``compute_s`` the step's own compute. Pure.

    >>> e = estimate(0.1, 1_000_000, 4, Link(12.5e6, 0.04, 0.8), 2, DilocoSetting(10))
    >>> round(e.outer_s, 3), round(e.comm_step_s, 4), round(e.step_s, 4), round(e.utilisation, 3)
    (0.48, 0.048, 0.148, 0.676)
    >>> e = estimate(0.1, 1_000_000, 4, Link(12.5e6, 0.04, 0.8), 2, DilocoSetting(10, overlap_steps=2))
    >>> round(e.comm_step_s, 4), round(e.utilisation, 3)     # 0.28 s of the 0.48 s exposed
    (0.028, 0.781)
    """
    outer = link.allreduce_s(outer_bytes(numel, itemsize, setting), ranks)
    exposed = max(0.0, outer - setting.overlap_steps * compute_s)
    per_step = exposed * setting.fragments / setting.inner_steps
    return DilocoEstimate(setting, compute_s, outer, per_step, compute_s + per_step)


@dataclass(frozen=True)
class LowCommAdvice:
    """DiLoCo's estimates beside the best per-step strategy's step, and the recommendation.

    ``recommendation`` is None unless the rule of :func:`advise` holds; ``reason`` says why
    either way."""

    compute_s: float  # the step with no communication under DiLoCo
    per_step_s: float  # the best per-step strategy's predicted step
    estimates: tuple[DilocoEstimate, ...]
    recommendation: DilocoEstimate | None
    reason: str
    per_step_compute_s: float | None = None  # its own step with no communication (None: compute_s)

    @property
    def per_step_utilisation(self) -> float:
        own = self.compute_s if self.per_step_compute_s is None else self.per_step_compute_s
        return own / self.per_step_s if self.per_step_s > 0 else 1.0

    def speedup(self, est: DilocoEstimate) -> float:
        """Throughput of ``est`` over the per-step strategy's, at the same batch."""
        return self.per_step_s / est.step_s

    def line(self, per_step_name: str = "the best per-step sync") -> str | None:
        """The recommendation in one line (None without one); the command is the caller's.

        Example::

            advice.line("ddp2 powersgd")
            # 'recommend --sync diloco (inner_steps=50): predicted utilisation 94% against 32% for ddp2
            #  powersgd, 2.9x the throughput (step 83.1 ms against 242 ms). It changes the optimisation: ...'
        """
        r = self.recommendation
        if r is None:
            return None
        opts = ", ".join(f"{k}={v}" for k, v in r.setting.sync_options().items())
        return (f"recommend --sync diloco ({opts}): predicted utilisation {percent(r.utilisation)} against "
                f"{percent(self.per_step_utilisation)} for {per_step_name}, {self.speedup(r):.1f}x the throughput "
                f"(step {r.step_s * 1e3:.3g} ms against {self.per_step_s * 1e3:.3g} ms)"
                + ("" if r.utilisation >= TARGET_UTILISATION else
                   f"; still communication-bound (under {TARGET_UTILISATION:.0%}): a larger inner_steps or batch "
                   "would gain more")
                + ". It changes the optimisation: check the loss (docs/sync.md, \"DiLoCo\": +1.8% held-out "
                  "loss at equal steps for H=50 on the GPT example, +2.8% with a bf16 outer exchange overlapped)")

    def as_record(self) -> dict:
        """For ``--json`` and ``stats()``: every estimate, the rule's figures and the recommendation."""
        rec = self.recommendation
        return {
            "per_step_s": self.per_step_s, "compute_s": self.compute_s,
            "per_step_compute_s": self.compute_s if self.per_step_compute_s is None else self.per_step_compute_s,
            "per_step_utilisation": self.per_step_utilisation,
            "rule": {"below_utilisation": LOW_UTILISATION, "min_speedup": MIN_SPEEDUP,
                     "target_utilisation": TARGET_UTILISATION},
            "estimates": [e.as_record(self.per_step_s) for e in self.estimates],
            "recommendation": None if rec is None else {
                **rec.as_record(self.per_step_s), "run_flags": " ".join(rec.setting.run_flags()[:3])
                + f" '{rec.setting.sync_options_json()}'"},
            "reason": self.reason,
        }


def choose(estimates: Sequence[DilocoEstimate]) -> DilocoEstimate:
    """The setting to name: the least change to the optimisation (:attr:`DilocoSetting.order`)
    whose utilisation reaches :data:`TARGET_UTILISATION`, else the fastest.

    >>> link = Link(12.5e6, 0.04, 0.8)
    >>> choose([estimate(0.1, 1_000_000, 4, link, 2, DilocoSetting(h)) for h in (10, 50)]).setting.inner_steps
    50
    """
    ordered = sorted(estimates, key=lambda e: e.setting.order)
    good = [e for e in ordered if e.utilisation >= TARGET_UTILISATION]
    return good[0] if good else min(ordered, key=lambda e: (e.step_s, e.setting.order))


def advise(compute_s: float, per_step_s: float, numel: int, itemsize: int, link: Link, ranks: int,
           settings: Sequence[DilocoSetting] = SETTINGS, per_step_compute_s: float | None = None) -> LowCommAdvice:
    """Price ``settings`` and apply the rule (module docstring) against a per-step strategy
    predicted at ``per_step_s``. ``compute_s``: the step without communication under DiLoCo
    (the plain data-parallel layout's); ``per_step_compute_s``: the per-step strategy's own,
    where its layout differs (default ``compute_s``), for its utilisation. Pure.

    >>> link = Link(12.5e6, 0.04, 0.8)                     # 100 Mbit/s, 40 ms
    >>> a = advise(0.1, 0.6, 1_000_000, 4, link, 2)
    >>> a.recommendation.setting.label(), round(a.per_step_utilisation, 3), round(a.speedup(a.recommendation), 2)
    ('diloco H=50', 0.167, 5.47)
    >>> advise(0.1, 0.15, 1_000_000, 4, link, 2).recommendation is None   # 67 % already
    True
    """
    own = compute_s if per_step_compute_s is None else per_step_compute_s
    if compute_s <= 0 or per_step_s <= 0 or ranks < 2 or not settings:
        return LowCommAdvice(compute_s, per_step_s, (), None,
                             "not priced: needs 2 or more replicas and a step with compute", own)
    ests = tuple(estimate(compute_s, numel, itemsize, link, ranks, s) for s in settings)
    util = own / per_step_s
    best = choose(ests)
    speedup = per_step_s / best.step_s
    if util >= LOW_UTILISATION:
        reason = (f"per-step sync is at {util:.0%} utilisation, not below {LOW_UTILISATION:.0%}: "
                  f"DiLoCo is not recommended")
        return LowCommAdvice(compute_s, per_step_s, ests, None, reason, own)
    if speedup < MIN_SPEEDUP:
        reason = (f"per-step sync is at {util:.0%} utilisation, but the best DiLoCo setting ({best.setting.label()}) "
                  f"predicts {speedup:.2f}x its throughput, under {MIN_SPEEDUP:g}x: not recommended")
        return LowCommAdvice(compute_s, per_step_s, ests, None, reason, own)
    reason = (f"per-step sync is at {util:.0%} utilisation (below {LOW_UTILISATION:.0%}) and "
              f"{best.setting.label()} predicts {speedup:.1f}x its throughput (at least {MIN_SPEEDUP:g}x)")
    return LowCommAdvice(compute_s, per_step_s, ests, best, reason, own)


__all__ = ["CODEC_WIDTHS", "LOW_UTILISATION", "MIN_SPEEDUP", "SETTINGS", "TARGET_UTILISATION", "DilocoEstimate",
           "DilocoSetting", "LowCommAdvice", "advise", "choose", "estimate", "outer_bytes", "percent"]
