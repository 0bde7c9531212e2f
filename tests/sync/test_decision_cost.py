"""What ``auto``'s decision step costs: the codecs are timed once, each rank of a node on
its own slice of the bucket, and not at all, or not for long, where they cannot help
(one process: timing needs no collectives, and the ranks' agreement is played by threads)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from slipstream.network.link import Link
from slipstream.process.timing import clock_for
from slipstream.sync import auto as engine_auto
from slipstream.sync import codec_costs
from slipstream.sync.accounting import StepRecord
from slipstream.sync.auto import COST_RUNS, AutoPolicy
from slipstream.sync.compress import make_codec
from slipstream.sync.compress.base import layout_from_shapes
from slipstream.sync.control import ControlWire
from slipstream.sync.levels import FLAT, HIERARCHICAL, LevelLinks
from slipstream.sync.options import SyncOptions
from slipstream.sync.policy import BucketInfo, HierarchicalCost

CPU = torch.device("cpu")
SLOW = Link.measured(ranks=4, alpha_s=1e-4, bytes_per_s=25e6)  # 200 Mbit/s: compression pays


@pytest.fixture(autouse=True)
def one_thread():
    # Two OpenMP threads on a loaded 2-core machine spin: a 256x256 PowerSGD took 0.5 s.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _step(shapes: list[tuple[int, ...]]) -> tuple[StepRecord, dict]:
    """One observed step whose one bucket holds rank-1 matrices (PowerSGD keeps them whole)."""
    torch.manual_seed(0)
    flat = torch.cat([torch.outer(torch.randn(s[0]), torch.randn(s[1])).reshape(-1) if len(s) == 2
                      else torch.randn(s) for s in shapes])
    key = tuple(range(len(shapes)))
    step = StepRecord(t_backward_start=None)
    step.numel[0], step.keys[0], step.outputs[0] = flat.numel(), key, flat
    return step, {key: layout_from_shapes(shapes)}


class _Counting:
    """make_codec, counting each codec's applications by the size it was given."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.real = codec_costs.make_codec

    def __call__(self, name, **kw):
        codec, calls = self.real(name, **kw), self.calls
        reduce = codec.reduce

        def counted(x, *a, **k):
            calls.append((name, x.numel()))
            return reduce(x, *a, **k)

        codec.reduce = counted
        return codec


class _ThreadWire:
    """The control wire of ``n`` ranks played by ``n`` threads of this process: ``agree``
    reduces the ranks' lists elementwise (MIN, MAX or SUM), as the gloo group does."""

    def __init__(self, n: int):
        self.size, self._barrier, self._lists = n, threading.Barrier(n, timeout=60), {}

    def rank(self, r: int) -> "_ThreadWire._Rank":
        return _ThreadWire._Rank(self, r)

    class _Rank:
        def __init__(self, wire: "_ThreadWire", r: int):
            self.wire, self.r, self.size = wire, r, wire.size

        def agree(self, values, op=None):
            w = self.wire
            w._lists[self.r] = list(values)
            w._barrier.wait()
            columns = list(zip(*(w._lists[r] for r in range(w.size))))
            reduce = {dist.ReduceOp.MIN: min, dist.ReduceOp.MAX: max}.get(op, sum)
            out = [float(reduce(c)) for c in columns]
            w._barrier.wait()
            return out


def _decide_on_ranks(levels, step, layouts, buckets, names, n_ranks):
    """decide_timed on ``n_ranks`` ranks (threads) of nodes of ``levels``' size; each rank's decisions."""
    k = levels.hierarchical.local_world_size
    wire = _ThreadWire(n_ranks)
    codecs = {n: make_codec(n) for n in names}
    models = {FLAT: levels.flat, HIERARCHICAL: levels.hierarchical}
    results: dict[int, object] = {}

    def run(r: int) -> None:
        try:
            auto = AutoPolicy(SyncOptions(), wire.rank(r), world_size=n_ranks, link=levels, prober=lambda: levels,
                              local_rank=r % k)
            results[r] = auto.decide_timed([0], step, clock_for(CPU), CPU, layouts, codecs, models, buckets)
        except BaseException as e:  # surfaced below, not lost in the thread
            results[r] = e
            wire._barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in range(n_ranks):
        if isinstance(results.get(r), BaseException):
            raise results[r]
    return [results[r] for r in range(n_ranks)]


def test_two_levels_each_local_rank_times_its_own_shard_and_the_node_adds_them(monkeypatch):
    levels = LevelLinks(SLOW, HierarchicalCost(SLOW, SLOW, local_world_size=2, num_nodes=2))
    step, layouts = _step([(512, 512), (512,)])
    counting = _Counting()
    monkeypatch.setattr(codec_costs, "make_codec", counting)
    buckets = [BucketInfo(0, step.numel[0], 0.01, layouts[step.keys[0]])]
    per_rank = _decide_on_ranks(levels, step, layouts, buckets, ("allreduce", "bf16", "powersgd"), n_ranks=4)
    n = step.numel[0]
    shard = -(-n // 2)
    # No rank timed the whole bucket: each timed its half (local rank 0 the first, 1 the rest).
    assert counting.calls and {size for _, size in counting.calls} == {shard, n - shard}, counting.calls
    explained = {(lv, d.explain()) for decisions in per_rank for lv, d in decisions.items()}
    assert len(explained) == 2, explained  # every rank decided the same on each level
    decisions = per_rank[0]
    flat = {b.codec: b.compute_s for b in decisions[FLAT].per_bucket}
    hier = {b.codec: b.compute_s for b in decisions[HIERARCHICAL].per_bucket}
    # Same plan on both levels here (PowerSGD at 200 Mbit/s): the whole bucket's cost (the
    # two halves') on flat, the 1/2 shard's share of it on hierarchical.
    assert set(flat) == set(hier) == {"powersgd"}, (decisions[FLAT].explain(), decisions[HIERARCHICAL].explain())
    assert flat["powersgd"] > 0 and abs(hier["powersgd"] - flat["powersgd"] * shard / n) < 1e-12
    assert set(decisions[FLAT].retained) == {"bf16", "powersgd"}


def test_the_gate_share_covers_the_whole_bucket_on_two_levels():
    # A bucket whose first half is rank 1 (PowerSGD keeps it) and second half full rank
    # (PowerSGD keeps a few percent): the share is the whole bucket's, not the first shard's
    # (local rank 0's alone gives 1.0).
    torch.manual_seed(0)
    low = torch.outer(torch.randn(256), torch.randn(256)).reshape(-1)
    high = torch.randn(256 * 256)
    step = StepRecord(t_backward_start=None)
    step.numel[0], step.keys[0], step.outputs[0] = 2 * 256 * 256, (0, 1), torch.cat([low, high])
    layouts = {(0, 1): layout_from_shapes([(256, 256), (256, 256)])}
    levels = LevelLinks(SLOW, HierarchicalCost(SLOW, SLOW, local_world_size=2, num_nodes=2))
    buckets = [BucketInfo(0, step.numel[0], 0.01, layouts[(0, 1)])]
    per_rank = _decide_on_ranks(levels, step, layouts, buckets, ("allreduce", "bf16", "powersgd"), n_ranks=2)
    kept = [decisions[FLAT].retained["powersgd"] for decisions in per_rank]
    energy_low = float(low.double().dot(low.double()))
    whole = energy_low / (energy_low + float(high.double().dot(high.double())))
    assert kept[0] == kept[1] and kept[0] < 0.99 and abs(kept[0] - whole) < 0.1, (kept, whole)


def test_a_codec_slower_than_the_wire_it_saves_is_timed_twice_not_every_run(monkeypatch):
    fast = Link.measured(ranks=2, alpha_s=1e-7, bytes_per_s=1e13)  # all-reduce of the bucket: ~1 us
    auto = AutoPolicy(SyncOptions(), ControlWire(None), world_size=2, link=fast, prober=lambda: fast)
    step, layouts = _step([(256, 256)])
    counting = _Counting()
    monkeypatch.setattr(codec_costs, "make_codec", counting)
    costs = auto.measure_costs([0], step, clock_for(CPU), CPU, layouts)
    runs = {name: sum(1 for n, _ in counting.calls if n == name) for name in ("bf16", "powersgd")}
    assert COST_RUNS > 2 and runs == {"bf16": 2, "powersgd": 2}, runs
    assert costs[(0, "powersgd")] > 0 and costs[(0, "allreduce")] == 0.0
    # On a slow link (all-reduce of the bucket: 2.6 s) the same codecs get every run.
    counting.calls.clear()
    auto.measure_costs([0], step, clock_for(CPU), CPU, layouts, link=Link.measured(ranks=2, alpha_s=0.0, bytes_per_s=1e5))
    assert sum(1 for n, _ in counting.calls if n == "powersgd") == COST_RUNS, counting.calls


def _two_buckets(shapes: list[tuple[int, int]]) -> tuple[StepRecord, dict]:
    """One observed step of two buckets (one matrix each, random full-rank gradients)."""
    torch.manual_seed(0)
    step, layouts = StepRecord(t_backward_start=None), {}
    for i, shape in enumerate(shapes):
        key = (i,)
        step.numel[i], step.keys[i] = shape[0] * shape[1], key
        step.outputs[i] = torch.randn(shape[0] * shape[1])
        layouts[key] = layout_from_shapes([shape])
    return step, layouts


def test_a_codec_too_slow_on_one_bucket_is_not_run_on_the_next(monkeypatch):
    fast = Link.measured(ranks=2, alpha_s=1e-7, bytes_per_s=1e13)  # every bucket's all-reduce: ~1 us
    auto = AutoPolicy(SyncOptions(), ControlWire(None), world_size=2, link=fast, prober=lambda: fast)
    step, layouts = _two_buckets([(256, 256), (256, 512)])
    counting = _Counting()
    monkeypatch.setattr(codec_costs, "make_codec", counting)
    shares: dict[str, float] = {}
    costs = auto.measure_costs([0, 1], step, clock_for(CPU), CPU, layouts, shares=shares)
    for name in ("bf16", "powersgd"):
        sizes = [size for n, size in counting.calls if n == name]
        # Bucket 0: the cold run, one warm run (twice too slow: stop), the share's application.
        # Bucket 1: not run; its cost is bucket 0's time per value times its size.
        assert sizes == [256 * 256] * 3, (name, sizes)
        assert costs[(1, name)] == pytest.approx(costs[(0, name)] * 2, rel=1e-9)
    # The gate's share comes from the bucket each codec ran on.
    assert set(shares) == {"bf16", "powersgd"} and 0.0 < shares["powersgd"] < 0.5 and shares["bf16"] > 0.99


def test_a_codec_is_still_timed_where_its_predicted_compute_would_pay(monkeypatch):
    # Twice too slow on the first bucket of a fast link, but the second bucket's wire time is
    # large (a latency of 1 s per message): its prediction is not a verdict, so it is timed.
    auto = AutoPolicy(SyncOptions(), ControlWire(None), world_size=2, link=None, prober=lambda: None)
    step, layouts = _two_buckets([(256, 256), (256, 256)])

    class _Wire:  # bucket 0: 1 us on the wire; bucket 1: 10 s
        def bucket_seconds(self, b, codec):
            return 1e-6 if b.index == 0 else 10.0

    counting = _Counting()
    monkeypatch.setattr(codec_costs, "make_codec", counting)
    auto.timing.time_codecs([0, 1], step, clock_for(CPU), CPU, layouts, lambda i: (0, step.numel[i], layouts[step.keys[i]]),
                            1.0, _Wire(), with_shares=False)
    runs = sum(1 for n, _ in counting.calls if n == "powersgd")
    assert runs == 2 + COST_RUNS, counting.calls  # 2 on bucket 0 (stopped early), every run on bucket 1


def test_shares_kept_leaves_unmeasured_codecs_ungated():
    import math

    assert engine_auto.shares_kept(["powersgd", "sign", "topk"], [4.0, -math.inf, 0.0], [1.0, -math.inf, 0.0]) == {
        "powersgd": 0.75}
    assert engine_auto.shares_kept(["bf16"], [1.0], [2.0]) == {"bf16": 0.0}  # clamped
