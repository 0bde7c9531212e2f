"""``auto``'s measurements of its candidate codecs: each one's compute time on the buckets, timed
locally on the training device, and the share of the gradient one application keeps (the
convergence gate's figure); the ranks agree the figures (:meth:`CodecTiming.agree`), and
:mod:`.auto` runs :func:`.policy.decide` on them once per level. Split from :mod:`.auto`, which
decides when to measure and what to do with the plan; this module only measures and agrees.

Example::

    timing = CodecTiming(SyncOptions(), world_size=2)
    costs = timing.measure_costs([0, 1], step, clock, device, layouts, link)   # {(0, 'bf16'): 2.1e-4, ...}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..network.link import Link
from ..process.timing import duration_s
from .accounting import StepRecord
from .compress import make_codec
from .compress.base import Codec, ErrorFeedback, Layout, Wire, shard_of
from .control import ControlWire
from .options import SyncOptions
from .policy import BucketInfo, FlatCost, HierarchicalCost, as_cost

# Timed runs of each candidate codec per bucket when auto decides (the first one, cold, is
# dropped; the least of the others is kept, and the ranks agree on the least of theirs). One
# burst of other load on a shared core can inflate a run several-fold (seen: PowerSGD costed
# at 10x its steady time, and auto chose bf16 at 1 Gbit/s), so no single run decides; but each
# run is paid in the decision step, once per bucket, codec and level (six runs made the MLP's
# step 0.65 s longer on 2 ranks and 2-3 s on 2x2, most of what 20-step runs lost to peers).
COST_RUNS = 4

class CodecTiming:
    """Times ``options``' candidate codecs (:attr:`SyncOptions.auto_candidates`) for a group of
    ``world_size`` ranks; ``local_rank``: this rank's place in its node, the slice it times
    where a level is hierarchical (:meth:`decide`)."""

    def __init__(self, options: SyncOptions, world_size: int, local_rank: int = 0):
        self.options = options
        self.candidates = options.auto_candidates
        self.world_size = world_size
        self.local_rank = local_rank

    def agree(self, order: list[int], last: StepRecord, clock: Any, device: torch.device,
              layouts: Mapping[Hashable, Layout | None], models: Mapping[str, Link | FlatCost | HierarchicalCost],
              buckets: list[BucketInfo], control: ControlWire
              ) -> tuple[dict[str, dict[tuple[int, str], float]], dict[str, float]]:
        """Time the candidate codecs on the buckets in ``order`` and agree the figures on
        ``control``: per level of ``models``, each (bucket, codec)'s compute seconds (a bucket of
        ``buckets`` not in ``order`` can only keep all-reduce: +inf for the others), and per lossy
        codec its retained share, what :func:`.policy.decide` takes.

        Each rank of a node times its own 1/k of every bucket (k ranks per node where a level
        is hierarchical, else k = 1: the whole bucket), the slice the hierarchical reducer
        gives that rank's codec. The ranks agree each slice's figures (MIN over the nodes:
        the run a transient burst of other load on one rank did not inflate), and their sum
        over the k slices is the whole bucket's: its codec cost, and its gradient's energy
        and what each codec loses of it (the convergence gate's share). A level's cost is the
        whole bucket's scaled by that level's codec input (flat: the bucket; hierarchical:
        a 1/k shard): a cast's cost is linear in the values it converts, PowerSGD's in its
        matrices' values at a fixed rank, top-k's and sign's nearly so.

        Why slices: every rank timing the whole bucket repeats the node's work k times (on a
        2x2 of 2 cores, 4 whole-bucket timings of the MLP's 25 MiB buckets), and timing only
        local rank 0's shard blinds the gate: on the ResNet that shard is the bucket's last
        layers, where PowerSGD kept 0.65 of the gradient against 0.35-0.41 of the whole, and
        auto planned PowerSGD at 200 Mbit/s on 2x2, which then missed the loss target."""
        names = list(self.candidates)
        cost_models = {level: as_cost(model, self.world_size) for level, model in models.items()}
        k = max((m.local_world_size for m in cost_models.values() if isinstance(m, HierarchicalCost)), default=1)
        # The early stop's yardstick: the bucket's uncompressed wire time on the slower level.
        slowest = max(cost_models.values(), key=lambda m: sum(
            m.bucket_seconds(BucketInfo(i, last.numel[i], 0.0, layouts.get(last.keys.get(i)), last.itemsize.get(i, 4)),
                             Codec()) for i in order))
        costs, energy, lost = self.time_slice(order, last, clock, device, layouts, self.local_rank % k, k, slowest)
        # One slot of figures per local rank; a rank fills its own, +inf elsewhere (MIN ignores
        # it): the costs, then per codec the energy of the pieces it was applied to and what it
        # lost of it (-inf where not measured: the sum over slices stays negative).
        width = len(order) * len(names) + 2 * len(names)
        mine = ([costs[(i, nm)] for i in order for nm in names]
                + [energy.get(nm, -math.inf) for nm in names] + [lost.get(nm, -math.inf) for nm in names])
        local = [math.inf] * (k * width)
        local[(self.local_rank % k) * width:(self.local_rank % k + 1) * width] = mine
        slots = control.agree(local, op=dist.ReduceOp.MIN)
        whole = [sum(slots[r * width + j] for r in range(k)) for j in range(width)]
        n_costs = len(order) * len(names)
        retained = shares_kept(names, whole[n_costs:n_costs + len(names)], whole[n_costs + len(names):])
        per_level: dict[str, dict[tuple[int, str], float]] = {}
        for level, cost_model in cost_models.items():
            agreed = {(b.index, nm): 0.0 if nm == "allreduce" else math.inf for b in buckets for nm in names}
            for b, i in enumerate(order):
                share = cost_model.codec_input(last.numel[i], None)[0] / max(1, last.numel[i])
                for j, nm in enumerate(names):
                    agreed[(i, nm)] = whole[b * len(names) + j] * share
            per_level[level] = agreed
        return per_level, retained

    def measure_costs(self, order: list[int], step: StepRecord, clock: Any, device: torch.device,
                      layouts: Mapping[Hashable, Layout | None],
                      link: Link | FlatCost | HierarchicalCost,
                      shares: dict[str, float] | None = None) -> dict[tuple[int, str], float]:
        """Local compute time (seconds) of each candidate codec on each bucket's codec input at
        ``link``'s level; no communication. With ``shares`` (a dict
        to fill), each lossy codec's retained share of those inputs (see :meth:`time_codecs`)."""
        cost_model = as_cost(link, self.world_size)

        def codec_input(i: int) -> tuple[int, int, Layout | None]:
            numel, layout = cost_model.codec_input(step.numel[i], layouts.get(step.keys.get(i)))
            return 0, min(numel, step.numel[i]), layout

        costs, energy, lost = self.time_codecs(order, step, clock, device, layouts, codec_input, 1.0, cost_model,
                                               with_shares=shares is not None)
        if shares is not None:
            names = list(lost)
            shares.update(shares_kept(names, [energy[nm] for nm in names], [lost[nm] for nm in names]))
        return costs

    def time_slice(self, order: list[int], step: StepRecord, clock: Any, device: torch.device,
                   layouts: Mapping[Hashable, Layout | None], part: int, parts: int,
                   wire_model: FlatCost | HierarchicalCost
                   ) -> tuple[dict[tuple[int, str], float], dict[str, float], dict[str, float]]:
        """:meth:`time_codecs` on slice ``part`` of ``parts`` of every bucket (the hierarchical
        reducer's shards: local rank ``part``'s of a node of ``parts`` ranks)."""

        def piece(i: int) -> tuple[int, int, Layout | None]:
            return shard_of(step.numel[i], layouts.get(step.keys.get(i)), part, parts)

        return self.time_codecs(order, step, clock, device, layouts, piece, float(parts), wire_model, with_shares=True)

    def time_codecs(self, order: list[int], step: StepRecord, clock: Any, device: torch.device,
                    layouts: Mapping[Hashable, Layout | None],
                    piece: Callable[[int], tuple[int, int, Layout | None]], scale: float,
                    wire_model: FlatCost | HierarchicalCost, with_shares: bool
                    ) -> tuple[dict[tuple[int, str], float], dict[str, float], dict[str, float]]:
        """Time each candidate codec on ``piece(i)`` = (start, length, layout) of each bucket i.

        Returns (costs, energy, lost): the least of the warm runs' times per (bucket, codec);
        and, with ``with_shares`` where ``step`` kept every bucket's reduced gradient, per lossy
        codec the energy sum ||g||^2 of the pieces it was applied to and its loss there,
        sum ||g - C(g)||^2 (the convergence gate's retained share is 1 - lost / energy):
        after the timed runs on the same gradient (so PowerSGD's warm start has settled, as
        over steps) the residuals are dropped and one more application is compared with its
        input (both empty: not measured).

        The codecs run on ``step``'s reduced gradients where the step kept them (auto's last
        observe step), else on random data of the same size, in one scratch buffer; DDP's
        buffers are not written. A codec whose first warm run, times ``scale`` (the pieces in
        a bucket), costs more than twice the bucket's whole uncompressed wire time gets no
        more runs: its compute alone outlasts the all-reduce it replaces. Such a codec is
        not run at all on a later bucket where its compute, predicted from that run's time
        per value, again outlasts twice the bucket's wire time: the prediction is its cost
        there (a codec's compute is linear in the values it converts, near enough for a
        verdict of twice too slow), and its share is measured on the pieces it ran on.
        Measured on the MLP over loopback: sign and top-k, five times too slow on every
        bucket, took most of a 0.7-0.9 s decision step by running on each of its buckets."""
        solo = Wire(None, size=1)
        costs: dict[tuple[int, str], float] = {}
        gen = torch.Generator(device=device).manual_seed(0)
        pieces = {i: piece(i) for i in order}
        largest = max((length for _, length, _ in pieces.values()), default=0)
        scratch: torch.Tensor | None = None
        with_shares = with_shares and bool(order) and all(i in step.outputs for i in order)
        zero = torch.zeros((), dtype=torch.float64, device=device)
        # Every lossy candidate has a figure, 0 where its pieces are empty (a node's last slice
        # of a small bucket): the slices' figures are summed.
        lossy = [name for name in self.candidates if name != "allreduce"]
        energy = {name: zero.clone() for name in lossy}
        lost = {name: zero.clone() for name in lossy}
        too_slow: dict[str, float] = {}  # codec -> seconds per value, where it was twice too slow
        for i in order:
            start, numel, layout = pieces[i]
            out = step.outputs.get(i)
            g = out.detach().reshape(-1)[start:start + numel] if out is not None else None
            dtype = g.dtype if g is not None else torch.float32
            g_sq = torch.dot(g, g).double() if with_shares and numel else None
            key = step.keys.get(i, i)
            uncompressed_s = wire_model.bucket_seconds(
                BucketInfo(i, step.numel[i], 0.0, layouts.get(step.keys.get(i)), step.itemsize.get(i, 4)), Codec())
            for name in self.candidates:
                if name == "allreduce" or numel == 0:
                    costs[(i, name)] = 0.0
                    continue
                if name in too_slow and too_slow[name] * numel * scale > 2.0 * uncompressed_s:
                    costs[(i, name)] = too_slow[name] * numel  # predicted: not run here
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
                        clock.synchronize(marks[-1:])
                        if duration_s(marks[1], marks[2]) * scale > 2.0 * uncompressed_s:
                            too_slow[name] = duration_s(marks[1], marks[2]) / numel
                            break
                clock.synchronize(marks[-1:])
                times = [duration_s(a, b) for a, b in zip(marks, marks[1:])]
                costs[(i, name)] = min(times[1:])  # the least disturbed by other processes
                if g_sq is not None:
                    if isinstance(trial, ErrorFeedback):
                        trial.forget_residuals()
                    diff = g - trial.reduce(x.copy_(g), solo, key, layout).reshape(-1)
                    lost[name] += torch.dot(diff, diff).double()
                    energy[name] += g_sq
        if not with_shares:
            return costs, {}, {}
        # One host read per codec, at the decision only.
        return costs, {name: float(v) for name, v in energy.items()}, {name: float(v) for name, v in lost.items()}


def shares_kept(names: list[str], energy: list[float], lost: list[float]) -> dict[str, float]:
    """Per codec, the convergence gate's retained share ``1 - lost / energy`` (clamped at 0)
    of the gradient pieces it was applied to; a codec with no energy measured (negative: not
    measured, or zero) has none, and the gate does not judge it.

    Example::

        shares_kept(["powersgd", "sign"], [4.0, -math.inf], [1.0, -math.inf])   # {'powersgd': 0.75}
    """
    return {nm: max(0.0, 1.0 - v / e) for nm, e, v in zip(names, energy, lost, strict=True) if e > 0.0 and v >= 0.0}


__all__ = ["COST_RUNS", "CodecTiming", "shares_kept"]
