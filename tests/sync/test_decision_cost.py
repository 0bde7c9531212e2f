"""What ``auto``'s decision step costs: the codecs are timed once, on the whole bucket,
and not at all, or not for long, where they cannot help (single process: timing
needs no collectives)."""

from __future__ import annotations

import pytest
import torch

from slipstream.link import Link
from slipstream.sync import auto as engine_auto
from slipstream.sync.accounting import StepRecord
from slipstream.sync.auto import COST_RUNS, AutoPolicy
from slipstream.sync.compress import make_codec
from slipstream.sync.compress.base import layout_from_shapes
from slipstream.sync.control import ControlWire
from slipstream.sync.levels import FLAT, HIERARCHICAL, LevelLinks
from slipstream.sync.options import SyncOptions
from slipstream.sync.policy import BucketInfo, HierarchicalCost
from slipstream.timing import clock_for

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
        self.real = engine_auto.make_codec

    def __call__(self, name, **kw):
        codec, calls = self.real(name, **kw), self.calls
        reduce = codec.reduce

        def counted(x, *a, **k):
            calls.append((name, x.numel()))
            return reduce(x, *a, **k)

        codec.reduce = counted
        return codec


def test_two_levels_are_timed_once_on_the_whole_bucket_and_the_shard_is_scaled(monkeypatch):
    levels = LevelLinks(SLOW, HierarchicalCost(SLOW, SLOW, local_world_size=2, num_nodes=2))
    auto = AutoPolicy(SyncOptions(), ControlWire(None), world_size=4, link=levels, prober=lambda: levels)
    step, layouts = _step([(512, 512), (512,)])
    counting = _Counting()
    monkeypatch.setattr(engine_auto, "make_codec", counting)
    buckets = [BucketInfo(0, step.numel[0], 0.01, layouts[step.keys[0]])]
    codecs = {n: make_codec(n) for n in ("allreduce", "bf16", "powersgd")}
    models = {FLAT: levels.flat, HIERARCHICAL: levels.hierarchical}
    decisions = auto.decide_timed([0], step, clock_for(CPU), CPU, layouts, codecs, models, buckets)
    shard = -(-step.numel[0] // 2)
    # Every application was on the whole bucket (the gate's share must see all of the
    # gradient): the 1/2 shard was not timed.
    assert counting.calls and {n for _, n in counting.calls} == {step.numel[0]}, counting.calls
    flat = {b.codec: b.compute_s for b in decisions[FLAT].per_bucket}
    hier = {b.codec: b.compute_s for b in decisions[HIERARCHICAL].per_bucket}
    # Same plan on both levels here (PowerSGD at 200 Mbit/s): the shard's cost is flat's, scaled.
    assert set(flat) == set(hier) == {"powersgd"}, (decisions[FLAT].explain(), decisions[HIERARCHICAL].explain())
    assert abs(hier["powersgd"] - flat["powersgd"] * shard / step.numel[0]) < 1e-12
    assert set(decisions[FLAT].retained) == {"bf16", "powersgd"}


def test_the_gate_share_covers_the_whole_bucket_on_two_levels(monkeypatch):
    # A bucket whose first half is rank 1 (PowerSGD keeps it) and second half full rank
    # (PowerSGD keeps a few percent): the share is the whole bucket's, not the first shard's.
    torch.manual_seed(0)
    low = torch.outer(torch.randn(256), torch.randn(256)).reshape(-1)
    high = torch.randn(256 * 256)
    step = StepRecord(t_backward_start=None)
    step.numel[0], step.keys[0], step.outputs[0] = 2 * 256 * 256, (0, 1), torch.cat([low, high])
    layouts = {(0, 1): layout_from_shapes([(256, 256), (256, 256)])}
    levels = LevelLinks(SLOW, HierarchicalCost(SLOW, SLOW, local_world_size=2, num_nodes=2))
    auto = AutoPolicy(SyncOptions(), ControlWire(None), world_size=4, link=levels, prober=lambda: levels)
    buckets = [BucketInfo(0, step.numel[0], 0.01, layouts[(0, 1)])]
    codecs = {n: make_codec(n) for n in ("allreduce", "bf16", "powersgd")}
    decisions = auto.decide_timed([0], step, clock_for(CPU), CPU, layouts, codecs,
                                  {FLAT: levels.flat, HIERARCHICAL: levels.hierarchical}, buckets)
    kept = decisions[FLAT].retained["powersgd"]
    energy_low = float(low.double().dot(low.double()))
    whole = energy_low / (energy_low + float(high.double().dot(high.double())))
    assert kept < 0.99 and abs(kept - whole) < 0.1, (kept, whole)


def test_a_codec_slower_than_the_wire_it_saves_is_timed_twice_not_every_run(monkeypatch):
    fast = Link.measured(ranks=2, alpha_s=1e-7, bytes_per_s=1e13)  # all-reduce of the bucket: ~1 us
    auto = AutoPolicy(SyncOptions(), ControlWire(None), world_size=2, link=fast, prober=lambda: fast)
    step, layouts = _step([(256, 256)])
    counting = _Counting()
    monkeypatch.setattr(engine_auto, "make_codec", counting)
    costs = auto.measure_costs([0], step, clock_for(CPU), CPU, layouts)
    runs = {name: sum(1 for n, _ in counting.calls if n == name) for name in ("bf16", "powersgd")}
    assert COST_RUNS > 2 and runs == {"bf16": 2, "powersgd": 2}, runs
    assert costs[(0, "powersgd")] > 0 and costs[(0, "allreduce")] == 0.0
    # On a slow link (all-reduce of the bucket: 2.6 s) the same codecs get every run.
    counting.calls.clear()
    auto.measure_costs([0], step, clock_for(CPU), CPU, layouts, link=Link.measured(ranks=2, alpha_s=0.0, bytes_per_s=1e5))
    assert sum(1 for n, _ in counting.calls if n == "powersgd") == COST_RUNS, counting.calls
