"""``auto``'s use of the policy: observe a few uncompressed steps, measure, decide, verify.

The pure rule is :func:`.policy.decide`; this module gathers its inputs on the
running engine and agrees them across ranks:

1. the link: the start-up probe's figures (``apply`` probes before the first
   step; ``request_probe()`` measures again), so the observation window only
   has to show when each bucket becomes ready;
2. :meth:`AutoPolicy.observe`: ``observe_steps`` uncompressed steps after DDP's
   first (it re-buckets after it); per bucket the earliest ready time seen;
3. each candidate codec's compute time on each bucket, timed locally, and
   (:meth:`AutoPolicy.measure_retained`) the share of the last observed step's
   averaged gradient one application of each codec keeps: the convergence gate;
4. one all-reduce on the control group (ready times MAX, costs and shares MIN),
   then :func:`.policy.decide` on the same figures on every rank;
5. :meth:`AutoPolicy.verify`: after a plan that compresses, ``verify_steps``
   steps under it are timed; a plan that is not faster is reverted.

Everything runs on the engine's comm thread, after a step's last bucket, in
the same order on every rank.

Example::

    auto = AutoPolicy(SyncOptions(), ControlWire(groups().control), world_size=2, link=link, prober=probe)
    if auto.observe(step, steps_done, clock, device, layouts, codecs):
        auto.choices          # {0: 'allreduce', 1: 'powersgd', ...}
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .accounting import StepRecord
from .compress import make_codec
from .compress.base import Codec, ErrorFeedback, Layout, Wire
from .control import ControlWire
from .options import SyncOptions
from .policy import BucketInfo, Decision, FlatCost, HierarchicalCost, as_cost, decide, verify_plan
from ..link import Link
from ..timing import duration_s

log = logging.getLogger("slipstream.sync")

# Timed runs of each candidate codec per bucket when auto decides (the first one, cold, is
# dropped). Five: one burst of other load on a shared core can inflate two or three of them
# several-fold (seen: PowerSGD costed at 10x its steady time, and auto chose bf16 at 1 Gbit/s).
COST_RUNS = 6
# Runs of each codec on the same gradient before its retained share is read: enough for
# PowerSGD's warm-started factors to settle (one power iteration per run).
RETAINED_WARM_RUNS = 4

LinkModel = Link | FlatCost | HierarchicalCost


class AutoPolicy:
    """The observe -> decide -> verify loop of ``auto`` (see the module docstring).

    State, as the engine reads it: ``choices`` (bucket index -> codec name; empty
    until the first decision), ``decision`` (the last :class:`~.policy.Decision`,
    with its figures), ``verification`` (the verdict on the plan, or None),
    ``verifying`` (the engine must keep its control step while True).
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
        self._observed: list[StepRecord] = []
        self._verify_baseline_s: float | None = None
        self._verify_samples: list[StepRecord] = []

    @property
    def verifying(self) -> bool:
        """True while a compressing plan is being timed (the engine's control step is needed)."""
        return self._verify_baseline_s is not None

    def reset(self) -> None:
        """Forget the plan and observe again (after a re-probe)."""
        self.choices, self._observed = {}, []
        self._verify_baseline_s, self.verification = None, None

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
        costs = self.measure_costs(order, last, clock, device, layouts)
        names = list(self.candidates)
        retained = self.measure_retained(order, last, device, layouts)
        last.outputs.clear()
        # Every rank decides from the same figures, agreed in one collective: ready times
        # MAX (the slowest rank's backward sets the step), codec costs MIN (negated under
        # MAX): the ranks run the same code on the same sizes, so the lower figure is the
        # one a transient burst of other load on one rank did not inflate. The retained
        # shares are computed from the same averaged gradient everywhere; MIN makes any
        # rounding difference between devices agree too (-1: not measured).
        kept = [retained.get(nm, -1.0) for nm in names]
        vals = self.control.agree(ready + [-costs[(i, nm)] for i in order for nm in names] + [-k for k in kept],
                                  op=dist.ReduceOp.MAX)
        n_costs = len(order) * len(names)
        ready, flat_costs = vals[: len(order)], [-v for v in vals[len(order):len(order) + n_costs]]
        retained = {nm: -v for nm, v in zip(names, vals[len(order) + n_costs:]) if -v >= 0.0}
        agreed = {(i, nm): flat_costs[k * len(names) + j] for k, i in enumerate(order) for j, nm in enumerate(names)}
        buckets = [BucketInfo(i, last.numel[i], r, layouts.get(last.keys.get(i))) for i, r in zip(order, ready)]
        self.decision = decide(
            buckets, self.link, self.world_size, agreed, {nm: codecs[nm] for nm in names},
            hidden_tolerance=self.options.hidden_tolerance,
            retained=retained, min_retained=self.options.min_retained,
        )
        self.choices = dict(self.decision.choices)
        if self.compressing() and self.options.verify_steps > 0:
            spans = sorted(s.span_s for s in self._observed)
            self._verify_baseline_s = spans[len(spans) // 2]
            self._verify_samples = []
        self._observed = []
        if dist.get_rank() == 0:
            log.info("%s", self.decision.explain())
            for line in self.decision.explain_buckets():
                log.info("sync %s: %s", self.name, line)
        return True

    def compressing(self) -> bool:
        """Whether the current plan compresses any bucket."""
        return any(n != "allreduce" for n in self.choices.values())

    def verify(self, step: StepRecord, clock: Any) -> bool:
        """Time ``verify_steps`` steps under the plan (after one to warm up); True when the
        plan measured no faster than the uncompressed steps and was reverted to all-reduce."""
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
        reason = verify_plan(uncompressed, planned)
        if reason is None:
            self.verification = (f"kept: measured {planned * 1e3:.1f} ms per backward+sync against "
                                 f"{uncompressed * 1e3:.1f} ms uncompressed")
            if dist.get_rank() == 0:
                log.info("sync %s: plan %s", self.name, self.verification)
            return False
        self.verification = f"reverted to allreduce: {reason}"
        self.choices = {i: "allreduce" for i in self.choices}
        if dist.get_rank() == 0:
            log.warning("sync %s: %s", self.name, self.verification)
        return True

    def measure_costs(self, order: list[int], step: StepRecord, clock: Any, device: torch.device,
                      layouts: Mapping[Hashable, Layout | None]) -> dict[tuple[int, str], float]:
        """Local compute time (seconds) of each candidate codec on each bucket (no communication)."""
        solo = Wire(None, size=1)
        assert self.link is not None
        cost_model = as_cost(self.link, self.world_size)
        costs: dict[tuple[int, str], float] = {}
        gen = torch.Generator(device=device).manual_seed(0)
        for name in self.candidates:
            for i in order:
                if name == "allreduce":
                    costs[(i, name)] = 0.0
                    continue
                trial = make_codec(name, **self.options.codec_kwargs(name))
                # What the codec is given: the bucket, or (hierarchical) its 1/k shard.
                numel, layout = cost_model.codec_input(step.numel[i], layouts.get(step.keys.get(i)))
                # On the training device, timed by its clock: a codec's cost on the GPU
                # is kernel time, not the host time of launching it.
                # A private generator: measuring must not move the training's RNG streams.
                x = torch.randn(numel, device=device, generator=gen)
                marks = [clock.mark()]
                for _ in range(COST_RUNS):  # later runs have warm-start state, like steady state
                    trial.reduce(x, solo, step.keys.get(i, i), layout)
                    marks.append(clock.mark())
                clock.synchronize(marks[-1:])
                times = [duration_s(a, b) for a, b in zip(marks, marks[1:])]
                costs[(i, name)] = min(times[1:])  # the least disturbed by other processes
        return costs

    def measure_retained(self, order: list[int], step: StepRecord, device: torch.device,
                         layouts: Mapping[Hashable, Layout | None]) -> dict[str, float]:
        """Per lossy candidate codec, the share of the gradient's energy one application keeps,
        1 - sum ||g - C(g)||^2 / sum ||g||^2 over the buckets, on ``step``'s reduced gradients
        (empty when the step kept none). Each codec first runs a few times on the same
        gradient, as it would over steps, so PowerSGD's warm-started factors have converged;
        then its residuals are dropped and one more application is compared with its input.
        Local, no communication; a copy of one bucket at a time."""
        if not step.outputs:
            return {}
        solo = Wire(None, size=1)
        assert self.link is not None
        cost_model = as_cost(self.link, self.world_size)
        lost: dict[str, torch.Tensor] = {}
        energy = torch.zeros((), dtype=torch.float64, device=device)
        for i in order:
            out = step.outputs.get(i)
            if out is None:
                continue
            # What the codec is given for this bucket: the bucket, or (hierarchical) its first shard.
            numel, layout = cost_model.codec_input(step.numel[i], layouts.get(step.keys.get(i)))
            g = out.detach().reshape(-1)[:numel]
            energy += torch.dot(g, g).double()
            for name in self.candidates:
                if name == "allreduce":
                    continue
                trial = make_codec(name, **self.options.codec_kwargs(name))
                key = step.keys.get(i, i)
                for _ in range(RETAINED_WARM_RUNS):
                    trial.reduce(g.clone(), solo, key, layout)
                if isinstance(trial, ErrorFeedback):
                    trial.forget_residuals()
                delivered = trial.reduce(g.clone(), solo, key, layout).reshape(-1)
                diff = g - delivered
                lost[name] = lost.get(name, torch.zeros_like(energy)) + torch.dot(diff, diff).double()
        total = float(energy)  # one host read per codec, at the decision only
        if not total > 0.0:
            return {}
        return {name: max(0.0, 1.0 - float(v) / total) for name, v in lost.items()}

    def figures(self) -> dict[str, Any]:
        """The decision and the figures behind it, for ``stats()`` (empty before the first)."""
        d = self.decision
        if d is None:
            return {}
        return {
            "sync_decisions": [b.as_record() for b in d.per_bucket],
            "sync_decision_reason": d.reason,
            "sync_predicted_s": d.predicted_s,
            "sync_predicted_allreduce_s": d.predicted_allreduce_s,
            "sync_predicted_backward_s": d.backward_s,
            "sync_link": d.link.summary(),
            "sync_retained": dict(d.retained),
            "sync_excluded": dict(d.excluded),
        }


__all__ = ["COST_RUNS", "RETAINED_WARM_RUNS", "AutoPolicy"]
