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
3. :meth:`AutoPolicy.decide_timed`: each candidate codec's compute time on those
   buckets, timed locally on the last observed step's averaged gradient (a run far
   slower than the bucket's wire time ends its codec's timing), and from the same
   runs the share of that gradient one application of each codec keeps: the
   convergence gate;
4. one all-reduce on the control group (costs and shares MIN), then
   :func:`.policy.decide` on the same figures on every rank;
5. :meth:`AutoPolicy.verify`: after a plan that compresses, ``verify_steps``
   steps under it are timed; a plan that is not faster is reverted.

Where the topology has both levels (``link`` is a :class:`~.levels.LevelLinks`),
the codecs are timed once, on the flat level's codec input (the whole bucket,
which the convergence gate's shares need; a hierarchical codec compresses the
1/k shard), and the hierarchical level's costs are those scaled by the inputs'
sizes; one agreement carries both,
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
import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .accounting import StepRecord
from .compress import make_codec
from .compress.base import Codec, ErrorFeedback, Layout, Wire
from .control import ControlWire
from .levels import FLAT, HIERARCHICAL, LevelLinks, choose_level, explain_level
from .options import SyncOptions
from .policy import BucketInfo, Decision, FlatCost, HierarchicalCost, as_cost, decide, verify_plan
from ..link import Link
from ..timing import clock_for, duration_s

log = logging.getLogger("slipstream.sync")

# Timed runs of each candidate codec per bucket when auto decides (the first one, cold, is
# dropped; the least of the others is kept, and the ranks agree on the least of theirs). One
# burst of other load on a shared core can inflate a run several-fold (seen: PowerSGD costed
# at 10x its steady time, and auto chose bf16 at 1 Gbit/s), so no single run decides; but each
# run is paid in the decision step, once per bucket, codec and level (six runs made the MLP's
# step 0.65 s longer on 2 ranks and 2-3 s on 2x2, most of what 20-step runs lost to peers).
COST_RUNS = 4

LinkModel = Link | FlatCost | HierarchicalCost | LevelLinks


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
                 prober: Callable[[], LinkModel], name: str = "auto"):
        self.options = options
        self.candidates = options.auto_candidates
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
        self._observed: list[StepRecord] = []
        self._verify_baseline_s: float | None = None
        self._verify_samples: list[StepRecord] = []
        self._lossy: set[str] = set()  # the candidates with error feedback (set at the decision)

    @property
    def verifying(self) -> bool:
        """True while a compressing plan is being timed (the engine's control step is needed)."""
        return self._verify_baseline_s is not None

    def reset(self) -> None:
        """Forget the plan and observe again (after a re-probe), on flat."""
        self.choices, self._observed = {}, []
        self._verify_baseline_s, self.verification = None, None
        self.level = FLAT

    def stop_verifying(self) -> None:
        """Nothing left to verify (the engine fell back)."""
        self._verify_baseline_s = None

    def observe(self, step: StepRecord, steps_done: int, clock: Any, device: torch.device,
                layouts: Mapping[Hashable, Layout | None], codecs: Mapping[str, Codec]) -> bool:
        """Record one uncompressed step; True when enough are in and the plan is decided."""
        # The first step runs with DDP's initial bucket order; it rebuilds buckets after it.
        if steps_done > 1 and step.t_backward_start is not None:
            self._observed.append(step)
            for s in self._observed[:-1]:  # only the newest step's gradients are measured
                s.outputs.clear()
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
        buckets = [BucketInfo(i, last.numel[i], r, layouts.get(last.keys.get(i))) for i, r in zip(order, ready)]
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
            self.level = choose_level(self.level_predicted_s)
            self.level_decision = explain_level(self.level, self.level_predicted_s, self.link)
            self.decision = decisions[self.level]
        else:
            self.decision = decisions["reducer"]
        self.choices = dict(self.decision.choices)
        self._lossy = {nm for nm in names if codecs[nm].error_feedback}
        # Verified against the observed (flat, uncompressed) steps: a plan that compresses, or
        # that moved to the hierarchical level.
        if (self.compressing() or self.level != FLAT) and self.options.verify_steps > 0:
            spans = sorted(s.span_s for s in self._observed)
            self._verify_baseline_s = spans[len(spans) // 2]
            self._verify_samples = []
        self._observed = []
        if dist.get_rank() == 0:
            if len(decisions) > 1:
                log.info("sync %s: %s", self.name, self.level_decision)
            log.info("%s", self.decision.explain())
            for line in self.decision.explain_buckets():
                log.info("sync %s: %s", self.name, line)
        return True

    def decide_timed(self, order: list[int], last: StepRecord, clock: Any, device: torch.device,
                      layouts: Mapping[Hashable, Layout | None], codecs: Mapping[str, Codec],
                      models: Mapping[str, Link | FlatCost | HierarchicalCost],
                      buckets: list[BucketInfo]) -> dict[str, Decision]:
        """Time the candidate codecs on each level's codec input for the buckets in ``order``,
        agree the figures, and decide once per level (the ready times in ``buckets`` are
        agreed already; a bucket not in ``order`` can only keep all-reduce)."""
        names = list(self.candidates)
        # The codecs are timed on one level's codec input: the largest, the whole bucket (with
        # two levels, flat's). The other level's costs are those scaled by the ratio of the
        # inputs' sizes: a cast's cost is linear in the values it converts, PowerSGD's in its
        # matrices' values at a fixed rank, top-k's and sign's nearly so. Timing both levels
        # added the hierarchical shard's runs to the 2x2 decision step (MLP at 1 Gbit/s:
        # 0.5 s). The retained shares come from the same runs (a separate pass cost the MLP's
        # decision step about 0.25 s), so they must see the whole gradient: timed on the
        # hierarchical shard (the bucket's first half: on the ResNet its last layers), PowerSGD
        # kept 0.65 of it where the whole gradient gives 0.35-0.41, and auto planned PowerSGD
        # on the ResNet 2x2 at 200 Mbit/s, which then missed the loss target.
        cost_models = {level: as_cost(model, self.world_size) for level, model in models.items()}

        def input_numel(level: str, i: int) -> int:
            return cost_models[level].codec_input(last.numel[i], layouts.get(last.keys.get(i)))[0]

        timed_level = max(cost_models, key=lambda lv: sum(input_numel(lv, i) for i in order))
        retained: dict[str, float] = {}
        timed = self.measure_costs(order, last, clock, device, layouts, link=models[timed_level], shares=retained)
        level_costs = [{(i, nm): t * input_numel(level, i) / max(1, input_numel(timed_level, i))
                        for (i, nm), t in timed.items()} for level in models]
        kept = [retained.get(nm, -1.0) for nm in names]
        local: list[float] = []
        for costs in level_costs:
            local += [costs[(i, nm)] for i in order for nm in names] + kept
        # Codec costs MIN: the ranks run the same code on the same sizes, so the lower figure
        # is the one a transient burst of other load on one rank did not inflate. The retained
        # shares are computed from the same averaged gradient everywhere; MIN makes any
        # rounding difference between devices agree too (-1: not measured). Both levels'
        # figures go in the same collective, so the level too is chosen from agreed figures.
        vals = self.control.agree(local, op=dist.ReduceOp.MIN)
        n_costs = len(order) * len(names)
        decisions: dict[str, Decision] = {}
        for level, model in models.items():
            flat_costs = vals[:n_costs]
            retained = {nm: v for nm, v in zip(names, vals[n_costs:n_costs + len(names)]) if v >= 0.0}
            vals = vals[n_costs + len(names):]
            agreed = {(b.index, nm): 0.0 if nm == "allreduce" else math.inf for b in buckets for nm in names}
            agreed.update({(i, nm): flat_costs[k * len(names) + j] for k, i in enumerate(order)
                           for j, nm in enumerate(names)})
            decisions[level] = decide(
                buckets, model, self.world_size, agreed, {nm: codecs[nm] for nm in names},
                hidden_tolerance=self.options.hidden_tolerance,
                retained=retained, min_retained=self.options.min_retained,
            )
        return decisions

    def compressing(self) -> bool:
        """Whether the current plan compresses any bucket."""
        return any(n != "allreduce" for n in self.choices.values())

    def verify(self, step: StepRecord, clock: Any) -> bool:
        """Time ``verify_steps`` steps under the plan (after one to warm up); True when the
        plan measured no faster than the uncompressed steps and was reverted to all-reduce
        (on flat, the level those steps were observed on)."""
        self._verify_samples.append(step)
        if len(self._verify_samples) < 1 + self.options.verify_steps:
            return False
        # Read the device times once, when all the verify steps are in.
        spans = sorted(s.resolve(clock).span_s for s in self._verify_samples[1:])
        # The slowest rank sets the step, on both sides.
        assert self._verify_baseline_s is not None
        planned, uncompressed = self.control.agree([spans[len(spans) // 2], self._verify_baseline_s],
                                                   op=dist.ReduceOp.MAX)
        self._verify_baseline_s = None
        self._verify_samples = []
        # A plan with an error-feedback codec trades some accuracy: it must measure clearly
        # faster, not merely tie all-reduce (seen: GPT at 1 Gbit/s kept PowerSGD on a
        # 121.6 ms against 121.6 ms measurement). A cast need only be faster.
        lossy = any(name in self._lossy for name in self.choices.values())
        reason = verify_plan(uncompressed, planned, min_gain=self.options.verify_min_gain if lossy else 0.0)
        if reason is None:
            self.verification = (f"kept: measured {planned * 1e3:.1f} ms per backward+sync against "
                                 f"{uncompressed * 1e3:.1f} ms uncompressed")
            if dist.get_rank() == 0:
                log.info("sync %s: plan %s", self.name, self.verification)
            return False
        where = f" (flat, from {self.level})" if self.level != FLAT else ""
        self.verification = f"reverted to allreduce{where}: {reason}"
        self.choices = {i: "allreduce" for i in self.choices}
        self.level = FLAT
        if dist.get_rank() == 0:
            log.warning("sync %s: %s", self.name, self.verification)
        return True

    def measure_costs(self, order: list[int], step: StepRecord, clock: Any, device: torch.device,
                      layouts: Mapping[Hashable, Layout | None],
                      link: Link | FlatCost | HierarchicalCost | None = None,
                      shares: dict[str, float] | None = None) -> dict[tuple[int, str], float]:
        """Local compute time (seconds) of each candidate codec on each bucket (no communication);
        ``link``: the level's cost model, whose codec input is timed (default: the policy's link).

        The codecs run on ``step``'s reduced gradients where the step kept them (auto's last
        observe step), else on random data of the same size. With ``shares`` (a dict to fill)
        and real gradients for every bucket, the same runs also give each lossy codec's
        retained share, 1 - sum ||g - C(g)||^2 / sum ||g||^2 over the buckets (the convergence
        gate's figure): after the timed runs on the same gradient (so PowerSGD's warm start
        has settled, as over steps) the residuals are dropped and one more application is
        compared with its input. A copy of one bucket at a time; DDP's buffers are not written."""
        solo = Wire(None, size=1)
        link = link if link is not None else self.link
        assert link is not None and not isinstance(link, LevelLinks)
        cost_model = as_cost(link, self.world_size)
        costs: dict[tuple[int, str], float] = {}
        gen = torch.Generator(device=device).manual_seed(0)
        scratch: torch.Tensor | None = None
        largest = max((cost_model.codec_input(step.numel[i], layouts.get(step.keys.get(i)))[0] for i in order),
                      default=0)
        with_shares = shares is not None and bool(order) and all(i in step.outputs for i in order)
        lost: dict[str, torch.Tensor] = {}
        energy = torch.zeros((), dtype=torch.float64, device=device)
        for i in order:
            # What the codec is given: the bucket, or (hierarchical) its 1/k shard.
            numel, layout = cost_model.codec_input(step.numel[i], layouts.get(step.keys.get(i)))
            out = step.outputs.get(i)
            g = out.detach().reshape(-1)[:numel] if out is not None else None
            dtype = g.dtype if g is not None else torch.float32
            if with_shares:
                energy += torch.dot(g, g).double()
            key = step.keys.get(i, i)
            uncompressed_s = cost_model.bucket_seconds(BucketInfo(i, step.numel[i], 0.0, layouts.get(step.keys.get(i))),
                                                       Codec())
            for name in self.candidates:
                if name == "allreduce":
                    costs[(i, name)] = 0.0
                    continue
                trial = make_codec(name, **self.options.codec_kwargs(name))
                # On the training device, timed by its clock: a codec's cost on the GPU
                # is kernel time, not the host time of launching it. A private generator:
                # measuring must not move the training's RNG streams.
                # One scratch buffer for every trial: a fresh copy of a large bucket per codec
                # costs more than the copy itself (new pages on the host; measured on the MLP,
                # 8 clones of 25 MiB took a quarter of the decision step).
                if scratch is None or scratch.numel() < numel or scratch.dtype != dtype:
                    scratch = torch.empty(largest, dtype=dtype, device=device)
                x = scratch[:numel]
                if g is not None:
                    x.copy_(g)
                else:
                    x.normal_(generator=gen)
                marks = [clock.mark()]
                for run in range(COST_RUNS):  # later runs have warm-start state, like steady state
                    trial.reduce(x, solo, key, layout)
                    marks.append(clock.mark())
                    if run == 1 and COST_RUNS > 2:
                        # A codec whose first warm run costs more than twice the bucket's whole
                        # uncompressed wire time cannot make that bucket faster (its compute
                        # alone outlasts the all-reduce it replaces): no more runs for it.
                        clock.synchronize(marks[-1:])
                        if duration_s(marks[1], marks[2]) > 2.0 * uncompressed_s:
                            break
                clock.synchronize(marks[-1:])
                times = [duration_s(a, b) for a, b in zip(marks, marks[1:])]
                costs[(i, name)] = min(times[1:])  # the least disturbed by other processes
                if with_shares:
                    if isinstance(trial, ErrorFeedback):
                        trial.forget_residuals()
                    diff = g - trial.reduce(x.copy_(g), solo, key, layout).reshape(-1)
                    lost[name] = lost.get(name, torch.zeros_like(energy)) + torch.dot(diff, diff).double()
        if with_shares:
            total = float(energy)  # one host read per codec, at the decision only
            if total > 0.0:
                assert shares is not None
                shares.update({name: max(0.0, 1.0 - float(v) / total) for name, v in lost.items()})
        return costs

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
        return {
            **levels,
            "sync_decisions": [b.as_record() for b in d.per_bucket],
            "sync_decision_reason": d.reason,
            "sync_predicted_s": d.predicted_s,
            "sync_predicted_allreduce_s": d.predicted_allreduce_s,
            "sync_predicted_backward_s": d.backward_s,
            "sync_link": d.link.summary(),
            "sync_retained": dict(d.retained),
            "sync_excluded": dict(d.excluded),
        }


__all__ = ["COST_RUNS", "AutoPolicy"]
