"""``auto``'s use of the policy: observe a few uncompressed steps, measure, decide, verify.

The pure rule is :func:`.policy.decide`; this module gathers its inputs on the
running engine and agrees them across ranks:

1. the link: the start-up probe's figures (``apply`` probes before the first
   step; ``request_probe()`` measures again), so the observation window only
   has to show when each bucket becomes ready;
2. :meth:`AutoPolicy.observe`: ``observe_steps`` uncompressed steps after DDP's
   first (it re-buckets after it); per bucket the earliest ready time seen; the
   ranks agree them (MAX), and :func:`.policy.decide` with every codec free of
   compute says which buckets a codec could help at all (none: nothing is timed);
3. :meth:`AutoPolicy.decide_timed` (measured by :mod:`.codec_costs`): each candidate codec's compute time on those
   buckets, timed locally on the last observed step's averaged gradient (a run far
   slower than the bucket's wire time ends its codec's timing), and from the same
   runs the share of that gradient one application of each codec keeps: the
   convergence gate. With k ranks per node each times its own 1/k slice of every
   bucket (the slice the hierarchical reducer gives its codec);
4. one all-reduce on the control group (each slice's figures MIN over the nodes,
   summed over the slices: the whole bucket's), then :func:`.policy.decide` on the
   same figures on every rank;
5. :meth:`AutoPolicy.verify`: after a plan that compresses, ``verify_steps``
   steps under it are timed; a plan that is not faster is reverted. Where the plan
   has an error-feedback codec and the best plan of casts alone is predicted close
   to it (``verify_runner_up``), the cast plan is timed first and the lossy plan
   is kept only if it measures clearly faster than the casts too.

Where the topology has both levels (``link`` is a :class:`~.levels.LevelLinks`),
the codecs are timed once (the node's k slices make the whole bucket, flat's codec
input and what the convergence gate's shares need), and each level's costs are the
whole bucket's scaled by its codec input's size; one agreement carries both,
:func:`.policy.decide` runs once per level and :func:`~.levels.choose_level`
takes the level predicted faster (``level``). A plan on the hierarchical level
is verified like a compressing one, against the flat uncompressed steps
observed; reverting goes to flat all-reduce.

Everything runs on the engine's comm thread, after a step's last bucket, in
the same order on every rank.

Example::

    auto = AutoPolicy(SyncOptions(), ControlWire(groups().control), world_size=2, link=link, prober=probe)
    if auto.observe(step, steps_done, clock, device, layouts, codecs):
        auto.choices          # {0: 'allreduce', 1: 'powersgd', ...}
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..log import CONSOLE
from ..network.link import Link
from ..network.lowcomm import LowCommAdvice, advise
from ..process.timing import clock_for, duration_s
from . import probe
from .accounting import StepRecord
from .codec_costs import COST_RUNS, CodecTiming, shares_kept
from .compress.base import Codec, Layout
from .control import ControlWire
from .levels import FLAT, HIERARCHICAL, LevelLinks, choose_level, explain_level
from .options import SyncOptions
from .policy import BucketInfo, Decision, FlatCost, HierarchicalCost, decide, verify_plan

log = logging.getLogger("slipstream.sync")

LinkModel = Link | FlatCost | HierarchicalCost | LevelLinks

# The start-up probe's two all-reduce sizes: a small one for the latency, and the model's
# whole gradient for the bandwidth, at most PROBE_MAX_BYTES (the probe's size before it was
# scaled) and at least PROBE_MIN_BYTES (a fit needs two sizes well apart). A fixed 4 MiB probe
# cost a 0.09M-parameter model (0.34 MB of gradients) 0.72-0.82 s at 200 Mbit/s, 5-6 % of a
# 15 s job, to measure a bandwidth at twelve times the size it would ever send (BENCHMARKS.md,
# "auto on a short job").
PROBE_SMALL_BYTES = 8 << 10
PROBE_MIN_BYTES = 64 << 10
PROBE_MAX_BYTES = 4 << 20


def probe_sizes(gradient_bytes: int) -> tuple[int, int]:
    """The start-up probe's (small, large) all-reduce sizes for a model of ``gradient_bytes``:
    the large one is the gradient itself, clamped to [PROBE_MIN_BYTES, PROBE_MAX_BYTES], so a
    small model's probe costs about what a few of its own steps' all-reduces cost and a large
    model's is the full one.

    Example::

        probe_sizes(340_000)     # (8192, 340000): a 0.09M-parameter model
        probe_sizes(12_900_000)  # (8192, 4194304): a 3.2M-parameter model probes fully
    """
    return PROBE_SMALL_BYTES, int(min(PROBE_MAX_BYTES, max(PROBE_MIN_BYTES, gradient_bytes)))


def flat_prober(group: Any, control: ControlWire, device: torch.device | str,
                gradient_bytes: int) -> Callable[[], Link]:
    """``auto``'s prober of one flat group: :func:`~.probe.probe_link` at :func:`probe_sizes`
    for a model of ``gradient_bytes``, agreed on ``control`` (the start-up probe and
    ``request_probe()``'s both).

    Example::

        prober = flat_prober(g.flat, ControlWire(g.control), "cpu", 340_000)
        prober().summary()   # "2 ranks, latency 1.62 ms, 0.215 Gbit/s", after ~0.1 s at 200 Mbit/s
    """
    sizes = probe_sizes(gradient_bytes)
    # Looked up when called, as _auto's own import did: a test's stand-in for the probe applies.
    return lambda: probe.probe_link(group, sizes_bytes=sizes, device=device, control=control)


def _logs() -> bool:
    """Whether this rank writes auto's log lines: rank 0 (or a process outside any group)."""
    return not dist.is_initialized() or dist.get_rank() == 0


class AutoPolicy:
    """The observe -> decide -> verify loop of ``auto`` (see the module docstring).

    State, as the engine reads it: ``choices`` (bucket index -> codec name; empty
    until the first decision), ``decision`` (the last :class:`~.policy.Decision`,
    with its figures), ``verification`` (the verdict on the plan, or None),
    ``verifying`` (the engine must keep its control step while True), ``level``
    (``"flat"``, or ``"hierarchical"`` where the link is a :class:`~.levels.LevelLinks`
    and the decision took that level), ``level_predicted_s`` (each level's predicted
    step at the last decision that chose between them) and ``level_decision`` (its log line).
    """

    def __init__(self, options: SyncOptions, control: ControlWire, world_size: int, link: LinkModel | None,
                 prober: Callable[[], LinkModel], name: str = "auto", local_rank: int = 0):
        self.options = options
        self.local_rank = local_rank  # this rank's place in its node: the slice it times
        self.candidates = options.auto_candidates
        # The codecs' compute and retained shares are measured by a collaborator (.codec_costs).
        self.timing = CodecTiming(options, world_size, local_rank)
        self.control = control
        self.world_size = world_size
        self.link = link
        self.prober = prober
        self.name = name
        self.choices: dict[int, str] = {}
        self.decision: Decision | None = None
        self.verification: str | None = None
        self.level = FLAT
        self.level_predicted_s: dict[str, float] = {}
        self.level_decision = ""  # the log line of the last choice between levels
        # Where the decision took the hierarchical level: the flat level's plan, which the
        # guard's trip on the hierarchical plan moves to (retreat_to_flat), once.
        self.flat_choices: dict[int, str] | None = None
        self.hierarchical_off: str | None = None  # why the hierarchical level is no longer taken
        self._observed: list[StepRecord] = []
        self._verify_baseline_s: float | None = None
        self._verify_samples: list[StepRecord] = []
        # Verifying two plans: the lossy plan still to time, and the cast plan's measured step.
        self._lossy_plan: dict[int, str] | None = None
        self._cast_measured: tuple[dict[int, str], float] | None = None
        self._lossy: set[str] = set()  # the candidates with error feedback (set at the decision)
        # The step before the newest observed (its count and record): the decision's step period.
        self._previous: tuple[int, StepRecord] | None = None
        # DiLoCo priced against the decision on the measured link (slipstream.network.lowcomm): a
        # recommendation only, auto never switches to it (it changes the optimisation).
        self.lowcomm: LowCommAdvice | None = None
        self.lowcomm_compute_from = ""  # how the step's compute was found: "measured" or "estimated"
        self.decision_line = ""  # the console line of the last decision (decision_line()), also in figures()

    @property
    def verifying(self) -> bool:
        """True while a compressing plan is being timed (the engine's control step is needed)."""
        return self._verify_baseline_s is not None

    def reset(self) -> None:
        """Forget the plan and observe again (after a re-probe), on flat."""
        self.choices, self._observed = {}, []
        self._verify_baseline_s, self.verification = None, None
        self._lossy_plan, self._cast_measured = None, None
        self.level, self.flat_choices = FLAT, None

    def window_state(self) -> dict[str, Any]:
        """A verification under way, as plain data for the sync state (the plan, ``choices``, is
        saved beside it): its baseline, the plan still to time and the cast plan's figure."""
        cast = self._cast_measured
        return {"verify_baseline_s": self._verify_baseline_s, "lossy_plan": self._lossy_plan,
                "cast_measured": None if cast is None else {"choices": cast[0], "s": cast[1]},
                "lossy": sorted(self._lossy)}

    def load_window_state(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`window_state`'s figures; the measurement windows start again here, on
        every rank alike: the observed and verified steps' marks were this process's own (a
        replacement healing in place has none, and its peers' would count the failed step)."""
        self._observed, self._verify_samples, self._previous = [], [], None
        state = state or {}
        self._verify_baseline_s = state.get("verify_baseline_s")
        plan = state.get("lossy_plan")
        self._lossy_plan = {int(k): v for k, v in plan.items()} if plan else None
        cast = state.get("cast_measured")
        self._cast_measured = ({int(k): v for k, v in cast["choices"].items()}, float(cast["s"])) if cast else None
        self._lossy = set(state.get("lossy", ()))

    def retreat_to_flat(self, reason: str) -> bool:
        """The guard tripped under a plan on the hierarchical level: take the flat level's plan
        of the same decision instead, and the hierarchical level no more this run. False (the
        engine falls back to uncompressed) where the plan is flat already.

        Why not the fallback: on the GPT at 2x2, ``auto``'s PowerSGD plans on the
        hierarchical level tripped the guard in 5 of 9 benchmark matrix runs and on the
        flat level in 1 of 38 (BENCHMARKS.md); uncompressed, the steps after the trip took
        about 1.6x as long as flat PowerSGD's."""
        if self.level != HIERARCHICAL or self.flat_choices is None:
            return False
        self.level, self.choices = FLAT, dict(self.flat_choices)
        self.flat_choices, self.hierarchical_off = None, reason
        self.stop_verifying()
        plan = ",".join(f"{k}:{v}" for k, v in sorted(Counter(self.choices.values()).items()))
        self.verification = f"moved to flat ({plan}): the guard stopped the hierarchical plan: {reason}"
        return True

    def stop_verifying(self) -> None:
        """Nothing left to verify (the engine fell back)."""
        self._verify_baseline_s = None
        self._lossy_plan, self._cast_measured = None, None

    def observe(self, step: StepRecord, steps_done: int, clock: Any, device: torch.device,
                layouts: Mapping[Hashable, Layout | None], codecs: Mapping[str, Codec]) -> bool:
        """Record one uncompressed step; True when enough are in and the plan is decided."""
        # The first step runs with DDP's initial bucket order; it rebuilds buckets after it.
        previous, self._previous = self._previous, (steps_done, step)
        if steps_done > 1 and step.t_backward_start is not None:
            self._observed.append(step)
            for s in self._observed[:-1]:  # only the newest step's gradients are measured
                s.outputs.clear()
        else:
            step.outputs.clear()  # never measured; kept one step longer for its marks only
        if len(self._observed) < self.options.observe_steps:
            return False
        # Device times of the observed steps: this waits for their events, on the few
        # observe steps only (the decision needs them; steady state never waits).
        for s in self._observed:
            s.resolve(clock)
        last = self._observed[-1]
        order = sorted(last.ready_s, key=lambda i: last.ready_s[i])
        # Per bucket, the earliest ready time seen: the least disturbed by other processes.
        ready = [min(s.ready_s[i] for s in self._observed if i in s.ready_s) for i in order]
        if self.link is None:
            self.link = self.prober()
        # One cost model per level auto may reduce on: the reducer's own (one level), or flat and hierarchical.
        models: dict[str, Link | FlatCost | HierarchicalCost] = (
            {FLAT: self.link.flat, HIERARCHICAL: self.link.hierarchical} if isinstance(self.link, LevelLinks)
            else {"reducer": self.link})
        names = list(self.candidates)
        # The ready times first (MAX: the slowest rank's backward sets the step), so that the
        # codecs are timed only where one could help: with every codec free of compute, a
        # plan that still compresses nothing (communication hidden, or too little exposed)
        # needs no timing, and the decision step costs one small all-reduce.
        ready = self.control.agree(ready, op=dist.ReduceOp.MAX)
        buckets = [BucketInfo(i, last.numel[i], r, layouts.get(last.keys.get(i)), last.itemsize.get(i, 4))
                   for i, r in zip(order, ready)]
        free = {(i, nm): 0.0 for i in order for nm in names}
        decisions = {level: decide(buckets, model, self.world_size, free, {nm: codecs[nm] for nm in names},
                                   hidden_tolerance=self.options.hidden_tolerance)
                     for level, model in models.items()}
        # The buckets a free codec would compress on some level: the others are not timed
        # (their communication is hidden, or queued behind nothing that compression shortens),
        # and keep all-reduce.
        timed = [i for i in order if any(d.choices.get(i, "allreduce") != "allreduce" for d in decisions.values())]
        if not timed:
            for d in decisions.values():
                d.reason += "; codecs not timed: none helps even at no compute cost"
        else:
            decisions = self.decide_timed(timed, last, clock, device, layouts, codecs, models, buckets)
        last.outputs.clear()
        if len(decisions) > 1:
            self.level_predicted_s = {lv: d.predicted_s for lv, d in decisions.items()}
            self.level = choose_level(self.level_predicted_s) if self.hierarchical_off is None else FLAT
            self.level_decision = explain_level(self.level, self.level_predicted_s, self.link)
            if self.hierarchical_off is not None:
                self.level_decision += f" (hierarchical is off for this run: {self.hierarchical_off})"
            self.decision = decisions[self.level]
            self.flat_choices = dict(decisions[FLAT].choices) if self.level == HIERARCHICAL else None
        else:
            self.decision = decisions["reducer"]
        self.choices = dict(self.decision.choices)
        before = previous[1] if previous is not None and previous[0] == steps_done - 1 else None
        self.price_lowcomm(last, before, clock)
        # Verified against the observed (flat, uncompressed) steps: a plan that compresses, or
        # that moved to the hierarchical level.
        spans = sorted(s.span_s for s in self._observed)
        runner_up = self.begin_verification(spans[len(spans) // 2],
                                            {nm for nm in names if codecs[nm].error_feedback})
        self._observed = []
        self.decision_line = decision_line(self.decision, codecs, last.itemsize, self.name,
                                           self.level if len(decisions) > 1 else None)
        if _logs():
            # The one line a user sees by default (extra=CONSOLE): what auto chose and why; the
            # figures behind it stay at info level below, for a user who configures logging.
            log.info("%s", self.decision_line, extra=CONSOLE)
            if len(decisions) > 1:
                log.info("sync %s: %s", self.name, self.level_decision)
            log.info("%s", self.decision.explain())
            for line in self.decision.explain_buckets():
                log.info("sync %s: %s", self.name, line)
            if runner_up is not None:
                assert self.decision.cast_predicted_s is not None
                log.info("sync %s: the plan of casts alone is predicted at %.1f ms, within %.0f%% of it: "
                         "verifying both, the casts first", self.name, self.decision.cast_predicted_s * 1e3,
                         self.options.verify_runner_up * 100)
            if self.recommendation():
                log.info("sync %s: %s", self.name, self.recommendation())
            elif self.lowcomm is not None:
                log.debug("sync %s: low-communication: %s", self.name, self.lowcomm.reason)
        return True

    def price_lowcomm(self, last: StepRecord, before: StepRecord | None, clock: Any) -> LowCommAdvice | None:
        """DiLoCo against the decision just taken, on the measured flat link: sets ``lowcomm`` and
        returns it (None where there is no flat link: ``hierarchical+auto``).

        The step's compute: the period from ``before``'s forward end to ``last``'s, less
        ``before``'s exposed communication (forward, backward, optimizer, the loop's own work);
        else, with no step before, 1.5 x the backward (forward as half the backward, the
        planner's rule; optimizer left out). With one observed step ``before`` is DDP's first,
        slower than later ones: the compute is then overstated, which lowers DiLoCo's predicted
        gain (the rule errs on the side of not recommending). Rank-local figures: nothing
        collective depends on them.

        Example::

            auto.price_lowcomm(last, before, clock).recommendation   # DilocoEstimate or None
        """
        d, link = self.decision, flat_link(self.link)
        self.lowcomm = None
        if d is None or link is None or not last.numel:
            return None
        compute_s, self.lowcomm_compute_from = 1.5 * d.backward_s, "estimated"
        if before is not None and before.t_backward_start is not None and last.t_backward_start is not None:
            before.resolve(clock)
            measured = duration_s(before.t_backward_start, last.t_backward_start) - before.exposed_s
            if measured > d.backward_s:  # else a clock or ordering surprise: keep the estimate
                compute_s, self.lowcomm_compute_from = measured, "measured"
        exposed = d.predicted_s - d.backward_s  # the plan's exposed communication and codec compute
        numel = sum(last.numel.values())
        itemsize = round(sum(n * last.itemsize.get(i, 4) for i, n in last.numel.items()) / max(1, numel))
        self.lowcomm = advise(compute_s, compute_s + exposed, numel, itemsize, link, self.world_size)
        return self.lowcomm

    def recommendation(self) -> str | None:
        """The line auto logs after deciding and ``stats()`` carries (``sync_recommendation``), with
        the flags to use; None where DiLoCo is not recommended."""
        a = self.lowcomm
        if a is None or a.recommendation is None:
            return None
        line = a.line(f"{self.name}'s plan (measured link)")
        flags = a.recommendation.setting.run_flags()
        return f"{line}: slipstream run {' '.join(flags[:3])} '{flags[3]}' ..."

    def begin_verification(self, uncompressed_s: float, lossy: set[str]) -> dict[int, str] | None:
        """After a decision (``decision``, ``choices`` and ``level`` set): start timing the plan
        against ``uncompressed_s`` (the observed steps' median), where it compresses or moved to
        the hierarchical level and ``verify_steps`` > 0. ``lossy``: the candidates with error
        feedback. Where ``decision`` has a cast plan predicted within ``verify_runner_up`` of a
        lossy plan, that cast plan runs first (``choices``) and is returned; else None.

        Example::

            auto.decision, auto.choices = d, dict(d.choices)
            auto.begin_verification(0.120, {"powersgd"})   # {0: 'bf16', 1: 'allreduce'}: the casts first
        """
        self._lossy = set(lossy)
        self._lossy_plan, self._cast_measured, self._verify_samples = None, None, []
        if not (self.compressing() or self.level != FLAT) or self.options.verify_steps <= 0:
            return None
        self._verify_baseline_s = uncompressed_s
        d, margin = self.decision, self.options.verify_runner_up
        if (d is None or margin <= 0 or not d.cast_choices or d.cast_predicted_s is None
                or not any(codec in self._lossy for codec in self.choices.values())
                or d.cast_predicted_s > d.predicted_s * (1 + margin)):
            return None
        self._lossy_plan, self.choices = self.choices, dict(d.cast_choices)
        return self.choices

    def decide_timed(self, order: list[int], last: StepRecord, clock: Any, device: torch.device,
                     layouts: Mapping[Hashable, Layout | None], codecs: Mapping[str, Codec],
                     models: Mapping[str, Link | FlatCost | HierarchicalCost],
                     buckets: list[BucketInfo]) -> dict[str, Decision]:
        """Time the candidates on the buckets in ``order``, agree the figures on this policy's
        control wire (:meth:`.codec_costs.CodecTiming.agree`), and decide once per level (the
        ready times in ``buckets`` are agreed already)."""
        names = list(self.candidates)
        costs, retained = self.timing.agree(order, last, clock, device, layouts, models, buckets, self.control)
        return {level: decide(buckets, model, self.world_size, costs[level], {nm: codecs[nm] for nm in names},
                              hidden_tolerance=self.options.hidden_tolerance,
                              retained=retained, min_retained=self.options.min_retained)
                for level, model in models.items()}

    def measure_costs(self, order: list[int], step: StepRecord, clock: Any, device: torch.device,
                      layouts: Mapping[Hashable, Layout | None],
                      link: Link | FlatCost | HierarchicalCost | None = None,
                      shares: dict[str, float] | None = None) -> dict[tuple[int, str], float]:
        """:meth:`.codec_costs.CodecTiming.measure_costs` at ``link``'s level (default: the policy's link)."""
        link = link if link is not None else self.link
        assert link is not None and not isinstance(link, LevelLinks)
        return self.timing.measure_costs(order, step, clock, device, layouts, link, shares)

    def compressing(self) -> bool:
        """Whether the current plan compresses any bucket."""
        return any(n != "allreduce" for n in self.choices.values())

    def verify(self, step: StepRecord, clock: Any) -> bool:
        """Time ``verify_steps`` steps under the plan (after one to warm up); True when the plan
        changed: it measured no faster than the uncompressed steps and was reverted to
        all-reduce (on flat, the level those steps were observed on), or, verifying two plans,
        the cast plan's steps are in and the lossy plan's begin, or the cast plan measured as
        fast as the lossy one and is kept."""
        self._verify_samples.append(step)
        if len(self._verify_samples) < 1 + self.options.verify_steps:
            return False
        # Read the device times once, when all the verify steps are in.
        spans = sorted(s.resolve(clock).span_s for s in self._verify_samples[1:])
        # The slowest rank sets the step, on both sides.
        assert self._verify_baseline_s is not None
        planned, uncompressed = self.control.agree([spans[len(spans) // 2], self._verify_baseline_s],
                                                   op=dist.ReduceOp.MAX)
        self._verify_samples = []
        if self._lossy_plan is not None:  # the cast plan's steps are in: now the lossy plan's
            self._cast_measured = (self.choices, planned)
            self.choices, self._lossy_plan = self._lossy_plan, None
            return True
        self._verify_baseline_s = None
        changed = False
        against = ""
        min_gain = self.options.verify_min_gain
        if self._cast_measured is not None:
            cast_choices, cast_s = self._cast_measured
            self._cast_measured = None
            against = f", the plan of casts alone {cast_s * 1e3:.1f} ms"
            # The lossy plan must measure clearly faster than the casts too, not merely tie them.
            if not planned < cast_s * (1 - min_gain):
                against = f"; the lossy plan measured {planned * 1e3:.1f} ms, not {min_gain:.0%} faster"
                self.choices, planned, changed = cast_choices, cast_s, True
        # A plan with an error-feedback codec trades some accuracy: it must measure clearly
        # faster, not merely tie all-reduce (seen: GPT at 1 Gbit/s kept PowerSGD on a
        # 121.6 ms against 121.6 ms measurement). A cast need only be faster.
        lossy = any(name in self._lossy for name in self.choices.values())
        reason = verify_plan(uncompressed, planned, min_gain=min_gain if lossy else 0.0)
        if reason is None:
            self.verification = (f"kept: measured {planned * 1e3:.1f} ms per backward+sync against "
                                 f"{uncompressed * 1e3:.1f} ms uncompressed{against}")
            if _logs():
                log.info("sync %s: plan %s", self.name, self.verification)
            return changed
        where = f" (flat, from {self.level})" if self.level != FLAT else ""
        self.verification = f"reverted to allreduce{where}: {reason}"
        self.choices = {i: "allreduce" for i in self.choices}
        self.level = FLAT
        if _logs():
            log.warning("sync %s: %s", self.name, self.verification)
        return True

    def measure_retained(self, order: list[int], step: StepRecord, device: torch.device,
                         layouts: Mapping[Hashable, Layout | None],
                         link: Link | FlatCost | HierarchicalCost | None = None) -> dict[str, float]:
        """Per lossy candidate codec, its retained share of ``step``'s reduced gradients (empty
        when the step kept none): the convergence gate's figure, by the same runs
        :meth:`measure_costs` makes at the decision."""
        shares: dict[str, float] = {}
        if step.outputs:
            self.measure_costs(order, step, clock_for(device), device, layouts, link=link, shares=shares)
        return shares

    def figures(self) -> dict[str, Any]:
        """The decision and the figures behind it, for ``stats()`` (empty before the first)."""
        d = self.decision
        if d is None:
            return {}
        levels = {}
        if self.level_predicted_s:  # the last decision chose between flat and hierarchical
            levels = {"sync_predicted_flat_s": self.level_predicted_s[FLAT],
                      "sync_predicted_hierarchical_s": self.level_predicted_s[HIERARCHICAL],
                      "sync_level_decision": self.level_decision}
        low = {}
        if self.lowcomm is not None:
            a = self.lowcomm
            low = {"sync_recommendation": self.recommendation(),
                   "sync_lowcomm": {"per_step_s": a.per_step_s, "compute_s": a.compute_s,
                                    "compute_from": self.lowcomm_compute_from,
                                    "per_step_utilisation": a.per_step_utilisation, "reason": a.reason,
                                    "utilisation": {e.setting.label(): e.utilisation for e in a.estimates},
                                    "recommended": None if a.recommendation is None else
                                    a.recommendation.as_record(a.per_step_s)}}
        return {
            **levels,
            **low,
            "sync_decision_line": self.decision_line,
            "sync_decisions": [b.as_record() for b in d.per_bucket],
            "sync_decision_reason": d.reason,
            "sync_predicted_s": d.predicted_s,
            "sync_predicted_allreduce_s": d.predicted_allreduce_s,
            "sync_predicted_backward_s": d.backward_s,
            "sync_link": d.link.summary(),
            "sync_retained": dict(d.retained),
            "sync_excluded": dict(d.excluded),
        }


def codec_label(name: str, codec: Codec) -> str:
    """A codec's name with the option that sets its size on the wire, as a user would write it.

    Example::

        codec_label("powersgd", make_codec("powersgd", rank=1))   # "powersgd rank 1"
    """
    for option in ("rank", "density"):  # PowerSGD's rank, top-k's density
        value = getattr(codec, option, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return f"{name} {option} {value:g}"
    return name


def decision_line(decision: Decision, codecs: Mapping[str, Codec], itemsize: Mapping[int, int],
                  name: str = "auto", level: str | None = None) -> str:
    """The one line ``auto`` prints when it decides, and the report shows: each codec with its
    buckets and their gradient bytes, the predicted backward+sync against all-reduce's, the
    measured link, and why. ``itemsize``: bytes per value by bucket index (4 where missing);
    ``level``: the level taken, where auto chose between flat and hierarchical.

    Example::

        decision_line(d, codecs, {0: 4, 1: 4, 2: 4, 3: 4})
        # "sync auto: powersgd rank 1 for 3 buckets (12.1 MB), allreduce for 1 (0.2 MB): predicted
        #  41.0 ms per backward+sync against 97.0 ms with all-reduce, on the measured link (2 ranks,
        #  latency 0.21 ms, 1.000 Gbit/s); communication exposed: compressing where it lowers the predicted step"
    """
    groups: dict[str, list[int]] = {}  # codec -> [buckets, bytes]
    for b in decision.per_bucket:
        group = groups.setdefault(b.codec, [0, 0])
        group[0] += 1
        group[1] += b.numel * itemsize.get(b.index, 4)
    parts = []
    for codec, (count, nbytes) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        label = codec_label(codec, codecs[codec]) if codec in codecs else codec
        what = f"{count} bucket{'s' if count != 1 else ''}" if not parts else str(count)
        size = f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes / 1e3:.1f} kB"  # never "0.0 MB"
        parts.append(f"{label} for {what} ({size})")
    where = f" on the {level} level" if level is not None else ""
    return (f"sync {name}: {', '.join(parts) or 'no buckets'}{where}: predicted "
            f"{decision.predicted_s * 1e3:.1f} ms per backward+sync against "
            f"{decision.predicted_allreduce_s * 1e3:.1f} ms with all-reduce, on the measured link "
            f"({decision.link.summary()}); {decision.reason}"
            + "".join(f"; {codec} left out: {why}" for codec, why in decision.excluded.items()))


def flat_link(model: LinkModel | None) -> Link | None:
    """The measured link of the whole group (where DiLoCo's outer all-reduce runs), or None
    where ``auto`` holds only the two levels' (``hierarchical+auto``)."""
    if isinstance(model, LevelLinks):
        return model.flat
    if isinstance(model, FlatCost):
        return model.link
    return model if isinstance(model, Link) else None



__all__ = ["COST_RUNS", "PROBE_MAX_BYTES", "PROBE_MIN_BYTES", "PROBE_SMALL_BYTES", "AutoPolicy", "codec_label",
           "decision_line", "flat_link",
           "flat_prober", "probe_sizes", "shares_kept"]
