"""Choose, per bucket, how to synchronise it: the alpha-beta model of one step.

Inputs, all measured and agreed across ranks before the decision:

* for each bucket, in the order DDP hands them over: its size, its layout and
  the time after the start of backward at which it became ready (observed
  over a few uncompressed steps);
* the link's latency and bandwidth (a measured :class:`~.link.Link`, from :mod:`.probe`);
* each candidate codec's compute time on each bucket (timed locally, no
  communication);
* optionally, per codec, the fraction of the gradient's energy one application
  of it keeps (``retained``, measured on the run's own gradient): the
  convergence gate. A codec that keeps less than ``min_retained`` is not a
  candidate, and the decision says so (:func:`convergence_gate`).

Model (one core per rank, as on the target machines, so compression compute
adds to compute rather than hiding behind it; communication waits do hide):

    core_end  = backward_s + sum(compute_i)
    chan_i    = max(ready_i, chan_{i-1}) + compute_i + comm_i
    step_end  = max(core_end, chan_last)

``comm_i`` comes from a cost object: :class:`FlatCost` (one all-reduce group:
``link.seconds(codec wire bytes, collectives)``) or :class:`HierarchicalCost`
(an uncompressed reduce-scatter + all-gather on the node's link, plus the codec
on 1/k of the bucket over the inter-node link, as :mod:`.hierarchical` runs it).

Start from plain all-reduce everywhere. If its predicted ``step_end`` is within
``hidden_tolerance`` of ``backward_s``, communication is already hidden: keep
it, compress nothing. Otherwise change, one bucket at a time, whichever
(bucket, codec) lowers the predicted step most, until nothing helps; and keep
the uncompressed plan anyway when the total predicted gain is under
``min_total_gain`` (10 %), which is within the model's error. Below that bar a
plan of casts alone (bf16/fp16: nothing kept between steps, verified after) is
still taken when it gains ``min_cast_gain`` (2 %): on the ResNet at 1 Gbit/s
the one exposed bucket's all-reduce costs about 22 ms of a ~250 ms step, and
torch's bf16 hook ran 9 % faster than DDP there while ``auto`` kept all-reduce.

Example::

    d = decide(buckets, link, world_size=2, compute_s=costs, candidates=codecs)
    d.choices        # {0: 'allreduce', 1: 'powersgd', ...}
    d.explain()
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..network.link import Link, allreduce_bytes
from .compress.base import Codec, Layout, shard_of
from .options import DEFAULTS


@dataclass(frozen=True)
class BucketInfo:
    index: int
    numel: int
    ready_s: float  # after the start of backward
    layout: Layout | None = None
    itemsize: int = 4  # bytes per gradient value: 2 for bf16/fp16 parameters


class FlatCost:
    """Time of a codec's collectives on a bucket, all ranks in one group."""

    def __init__(self, link: Link, world_size: int):
        self.link = link
        self.world_size = world_size

    def bucket_seconds(self, bucket: BucketInfo, codec: Codec) -> float:
        wire = codec.wire_bytes(bucket.numel, self.world_size, bucket.layout, bucket.itemsize)
        return self.link.seconds(wire, codec.collectives_per_call)

    def codec_input(self, numel: int, layout: Layout | None) -> tuple[int, Layout | None]:
        """What the codec itself is given for a bucket: here, the whole bucket."""
        return numel, layout

    def summary(self) -> str:
        return self.link.summary()


class HierarchicalCost:
    """Two levels: nodes of ``local_world_size`` ranks on ``intra``, nodes joined by ``inter``.

    Per bucket of S bytes: reduce-scatter + all-gather inside the node move
    2(k-1)/k * S per rank uncompressed (two collectives on the intra link); the
    codec runs on the 1/k shard over ``num_nodes`` ranks on the inter link.
    """

    def __init__(self, intra: Link, inter: Link, local_world_size: int, num_nodes: int):
        self.intra, self.inter = intra, inter
        self.local_world_size, self.num_nodes = local_world_size, num_nodes

    def codec_input(self, numel: int, layout: Layout | None) -> tuple[int, Layout | None]:
        """The shard the codec compresses (local rank 0's: every rank predicts from the same one)."""
        if self.local_world_size == 1:
            return numel, layout
        return -(-numel // self.local_world_size), shard_of(numel, layout, 0, self.local_world_size)[2]

    def bucket_seconds(self, bucket: BucketInfo, codec: Codec) -> float:
        k = self.local_world_size
        t = 0.0
        if k > 1:
            # reduce-scatter + all-gather: together the bytes of one all-reduce, in two collectives
            t += self.intra.seconds(allreduce_bytes(bucket.numel * bucket.itemsize, k), 2)
        if self.num_nodes > 1:
            shard, layout = self.codec_input(bucket.numel, bucket.layout)
            t += self.inter.seconds(codec.wire_bytes(shard, self.num_nodes, layout, bucket.itemsize),
                                    codec.collectives_per_call)
        return t

    def summary(self) -> str:
        return f"intra-node {self.intra.summary()}; inter-node {self.inter.summary()}"


def as_cost(link: Link | FlatCost | HierarchicalCost, world_size: int) -> FlatCost | HierarchicalCost:
    """A cost object for ``link``: a plain link means one flat group of ``world_size`` ranks."""
    return FlatCost(link, world_size) if isinstance(link, Link) else link


@dataclass(frozen=True)
class BucketChoice:
    """One bucket's choice and the figures behind it (seconds, predicted for the chosen codec)."""

    index: int
    numel: int
    codec: str
    ready_s: float  # after the start of backward, agreed over ranks
    compute_s: float  # the codec's measured compute on this bucket
    comm_s: float  # the codec's collectives on this bucket, from the link model

    def as_record(self) -> dict[str, float | int | str]:
        """A flat dict for the metrics records (``stats()['sync_decisions']``)."""
        return {"bucket": self.index, "numel": self.numel, "codec": self.codec, "ready_s": self.ready_s,
                "compute_s": self.compute_s, "comm_s": self.comm_s}


@dataclass
class Decision:
    choices: dict[int, str]
    predicted_s: float  # backward + exposed communication, chosen plan
    predicted_allreduce_s: float
    backward_s: float
    link: Link | FlatCost | HierarchicalCost
    reason: str
    alternatives: dict[str, float] = field(default_factory=dict)  # every bucket with one codec
    per_bucket: list[BucketChoice] = field(default_factory=list)  # in backward order
    retained: dict[str, float] = field(default_factory=dict)  # per codec: energy kept by one application
    excluded: dict[str, str] = field(default_factory=dict)  # codec -> why the convergence gate left it out
    # Where the plan has an error-feedback codec: the best plan of casts and all-reduce alone, and
    # its predicted step, when it beats all-reduce (else empty / None). auto may time both.
    cast_choices: dict[int, str] = field(default_factory=dict)
    cast_predicted_s: float | None = None

    def explain_buckets(self) -> list[str]:
        """One line per bucket: its choice and the predicted figures behind it."""
        return [
            f"bucket {b.index} ({b.numel} values, ready at {b.ready_s * 1e3:.1f} ms): {b.codec}, "
            f"compute {b.compute_s * 1e3:.2f} ms, comm {b.comm_s * 1e3:.2f} ms"
            for b in self.per_bucket
        ]

    def explain(self) -> str:
        counts: dict[str, int] = {}
        for name in self.choices.values():
            counts[name] = counts.get(name, 0) + 1
        plan = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        alts = ", ".join(f"{k} {v * 1e3:.1f} ms" if math.isfinite(v) else f"{k} n/a"
                         for k, v in self.alternatives.items())
        return (
            f"sync auto: {plan}; predicted backward+exposed comm {self.predicted_s * 1e3:.1f} ms "
            f"(all-reduce {self.predicted_allreduce_s * 1e3:.1f} ms, backward {self.backward_s * 1e3:.1f} ms; "
            f"uniform plans: {alts}); link {self.link.summary()}; {self.reason}"
            + "".join(f"; {name} left out: {why}" for name, why in self.excluded.items())
        )


def predict(
    buckets: list[BucketInfo],
    choices: Mapping[int, str],
    link: Link | FlatCost | HierarchicalCost,
    world_size: int,
    compute_s: Mapping[tuple[int, str], float],
    codecs: Mapping[str, Codec],
) -> float:
    """Predicted end of backward + exposed communication, in seconds after backward starts.

    ``link``: a measured :class:`~.link.Link` (one flat group of ``world_size`` ranks) or a cost object.
    """
    cost_model = as_cost(link, world_size)
    backward = max((b.ready_s for b in buckets), default=0.0)
    core = backward
    chan = 0.0
    for b in buckets:
        name = choices[b.index]
        codec = codecs[name]
        cost = compute_s.get((b.index, name), 0.0)
        core += cost
        comm = cost_model.bucket_seconds(b, codec)
        chan = max(b.ready_s, chan) + cost + comm
    return max(core, chan)


def decide(
    buckets: list[BucketInfo],
    link: Link | FlatCost | HierarchicalCost,
    world_size: int,
    compute_s: Mapping[tuple[int, str], float],
    candidates: Mapping[str, Codec],
    hidden_tolerance: float = DEFAULTS.hidden_tolerance,
    min_gain: float = 0.01,
    min_total_gain: float = 0.10,
    min_cast_gain: float = 0.02,
    retained: Mapping[str, float] | None = None,
    min_retained: float = DEFAULTS.min_retained,
) -> Decision:
    """Per-bucket codec names minimising :func:`predict`; see the module docstring."""
    if "allreduce" not in candidates:
        raise ValueError("candidates must include 'allreduce' (the uncompressed fallback)")
    retained = dict(retained or {})
    excluded = convergence_gate(retained, min_retained)
    candidates = {k: v for k, v in candidates.items() if k not in excluded}
    gate = {"retained": retained, "excluded": excluded}
    backward = max((b.ready_s for b in buckets), default=0.0)
    choices = {b.index: "allreduce" for b in buckets}
    base = predict(buckets, choices, link, world_size, compute_s, candidates)
    alternatives = {
        name: predict(buckets, {b.index: name for b in buckets}, link, world_size, compute_s, candidates)
        for name in candidates
    }
    if base <= backward * (1 + hidden_tolerance) + 1e-4:
        return Decision(
            choices, base, base, backward, link, alternatives=alternatives,
            reason="communication is hidden under backward: nothing compressed",
            per_bucket=_per_bucket(buckets, choices, link, world_size, compute_s, candidates), **gate,
        )

    def greedy(names: Mapping[str, Codec]) -> tuple[dict[int, str], float]:
        plan, best = {b.index: "allreduce" for b in buckets}, base
        while True:
            move, move_t = None, best
            for b in buckets:
                for name in names:
                    if name == plan[b.index]:
                        continue
                    t = predict(buckets, {**plan, b.index: name}, link, world_size, compute_s, candidates)
                    if t < move_t:
                        move, move_t = (b.index, name), t
            if move is None or move_t > best * (1 - min_gain / max(1, len(buckets))):
                return plan, best
            plan[move[0]] = move[1]
            best = move_t

    choices, best = greedy(candidates)
    lossless = {k: v for k, v in candidates.items() if not v.error_feedback}  # all-reduce and the casts
    if best >= base:
        reason = "communication exposed, but no codec is predicted to help"
    elif base - best < min_total_gain * base:
        # A small predicted gain is within the model's error on a shared machine: do not
        # trade accuracy (and risk a slower step) for it. A cast is another matter: it keeps
        # nothing between steps, halves the bytes, and verification reverts it if it measures
        # slower; so the best plan of casts alone is taken from a smaller gain.
        gain = (base - best) / base
        choices, best = greedy(lossless) if len(lossless) > 1 else ({b.index: "allreduce" for b in buckets}, base)
        cast_gain = (base - best) / base
        if best < base and cast_gain >= min_cast_gain:
            reason = (f"compression predicted to save only {gain:.0%} (< {min_total_gain:.0%}); casts alone "
                      f"{cast_gain:.0%} (>= {min_cast_gain:.0%}): casting where it lowers the predicted step")
        else:
            choices, best = {b.index: "allreduce" for b in buckets}, base
            reason = f"compression predicted to save only {gain:.0%} (< {min_total_gain:.0%}): nothing compressed"
    else:
        reason = "communication exposed: compressing where it lowers the predicted step"
    cast_choices: dict[int, str] = {}
    cast_predicted_s: float | None = None
    if any(candidates[n].error_feedback for n in choices.values()) and len(lossless) > 1:
        plan, predicted = greedy(lossless)
        if predicted < base:  # the casts beat all-reduce: auto may verify them beside the plan
            cast_choices, cast_predicted_s = plan, predicted
    return Decision(choices, best, base, backward, link, alternatives=alternatives, reason=reason,
                    per_bucket=_per_bucket(buckets, choices, link, world_size, compute_s, candidates), **gate,
                    cast_choices=cast_choices, cast_predicted_s=cast_predicted_s)


def convergence_gate(retained: Mapping[str, float], min_retained: float) -> dict[str, str]:
    """The codecs to leave out, each with why: those that keep less than ``min_retained`` of
    the gradient's energy per application (``retained``: codec -> 1 - ||g - C(g)||^2/||g||^2
    over all buckets). Error feedback sends the rest later, so a codec far below the bar
    delivers most of each step's update steps late: measured on the ResNet example, PowerSGD
    keeping 35-41 % of it slowed convergence in every run. ``allreduce`` is never left out.

    Example::

        convergence_gate({"powersgd": 0.27, "bf16": 1.0}, 0.5)
        # {'powersgd': 'keeps 27% of the gradient's energy per step (< 50%): convergence would suffer'}
    """
    return {
        name: (f"keeps {kept:.0%} of the gradient's energy per step (< {min_retained:.0%}): "
               "convergence would suffer")
        for name, kept in retained.items()
        if name != "allreduce" and kept < min_retained
    }


def _per_bucket(
    buckets: list[BucketInfo],
    choices: Mapping[int, str],
    link: Link | FlatCost | HierarchicalCost,
    world_size: int,
    compute_s: Mapping[tuple[int, str], float],
    codecs: Mapping[str, Codec],
) -> list[BucketChoice]:
    cost_model = as_cost(link, world_size)
    return [
        BucketChoice(b.index, b.numel, choices[b.index], b.ready_s, compute_s.get((b.index, choices[b.index]), 0.0),
                     cost_model.bucket_seconds(b, codecs[choices[b.index]]))
        for b in buckets
    ]


def verify_plan(uncompressed_s: float, planned_s: float, min_gain: float = 0.0) -> str | None:
    """None when the chosen plan *measured* faster than the uncompressed steps; else why to revert.

    Both figures are medians of backward + exposed synchronisation (seconds from the
    end of forward to the last bucket's result), taken the same way before and after
    the decision. The model can be wrong (a codec's cost mismeasured under load, a link
    that changed): this closes the loop on what actually happened.

    Example::

        verify_plan(0.300, 0.120)   # None: keep the plan
        verify_plan(0.050, 0.061)   # 'the plan measured 61.0 ms ... uncompressed 50.0 ms'
    """
    if planned_s < uncompressed_s * (1 - min_gain):
        return None
    bar = "not faster" if min_gain <= 0 else f"not {min_gain:.0%} faster, as a plan with a lossy codec must be"
    return (
        f"the plan measured {planned_s * 1e3:.1f} ms per backward+sync against {uncompressed_s * 1e3:.1f} ms "
        f"uncompressed: {bar}"
    )

