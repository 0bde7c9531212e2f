"""Block shuffle ("shards" order): exact coverage, resume at any world size, locality, memory, old states."""

from __future__ import annotations

import collections
import itertools
import random
import time
import tracemalloc

import numpy as np
import pytest

from slipstream.data import ResumableSampler, ShardedDataset, SlipstreamLoader
from slipstream.data.block_order import BlockOrder
from slipstream.errors import ConfigError

UNEVEN = [7, 0, 13, 5, 9, 11, 3, 8, 1, 20, 4, 4, 17]  # an empty shard, a one-sample shard, a large one


def _sampler(sizes, rank, world, **kw):
    kw.setdefault("seed", 3)
    return ResumableSampler(int(sum(sizes)), rank=rank, world_size=world, shard_sizes=sizes, **kw)


def _epoch(sizes, world, **kw) -> list[list[int]]:
    return [list(_sampler(sizes, r, world, **kw)) for r in range(world)]


def test_block_order_is_a_permutation_that_keeps_windows_together():
    sizes = np.array(UNEVEN)
    o = BlockOrder(sizes, seed=1, epoch=2, window_shards=3)
    got = o.samples(np.arange(o.num_samples))
    assert sorted(got.tolist()) == list(range(int(sizes.sum())))
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    shard = np.searchsorted(starts, got, side="right") - 1
    for w in range(o.num_windows):  # each window's positions hold exactly its shards' samples
        lo, hi = o.window_starts[w], o.window_starts[w + 1]
        assert set(shard[lo:hi].tolist()) <= set(o.shard_order[w * 3 : w * 3 + 3].tolist())
    assert not np.array_equal(got, BlockOrder(sizes, seed=1, epoch=3, window_shards=3).samples(np.arange(o.num_samples)))


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_per_epoch(world, drop_last):
    n = sum(UNEVEN)
    for window in (1, 2, 4):
        parts = _epoch(UNEVEN, world, window_shards=window, drop_last=drop_last)
        assert len({len(p) for p in parts}) == 1  # equal lengths keep DDP ranks in step
        counts = collections.Counter(i for p in parts for i in p)
        if drop_last:
            assert max(counts.values()) == 1 and len(counts) == n - n % world
        else:
            assert set(counts) == set(range(n)) and sum(counts.values()) - n == (-n) % world
    assert _sampler(UNEVEN, 0, 1).mode == "shards"
    assert _epoch(UNEVEN, 2) == _epoch(UNEVEN, 2) != _epoch(UNEVEN, 2, seed=4)


def test_resume_exact_at_the_same_and_at_other_world_sizes():
    """Mid-epoch state -> same W: the very same rest; other W (twice): every sample once, + end padding."""
    rng = random.Random(0)
    for _ in range(150):
        sizes = [rng.randint(0, 15) for _ in range(rng.randint(1, 12))]
        w1, w2, w3 = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 6)
        n = sum(sizes)
        if n < max(w1, w2, w3):
            continue
        kw = dict(window_shards=rng.randint(1, 4), drop_last=rng.random() < 0.3, seed=rng.randint(0, 99))
        full = _epoch(sizes, w1, **kw)
        k1 = rng.randint(0, len(full[0]))
        s = _sampler(sizes, 0, w1, **kw)
        s.advance(k1)
        state = s.state_dict()
        for r in range(w1):
            t = _sampler(sizes, r, w1, **kw | {"seed": 0})  # the seed comes from the state
            t.load_state_dict(state)
            assert full[r][:k1] + list(t) == full[r]
        if s.epoch_done:
            continue
        read = [i for p in full for i in p[:k1]]
        second = []
        for r in range(w2):
            t = _sampler(sizes, r, w2, **kw)
            t.load_state_dict(state)
            second.append(list(t))
        assert len({len(p) for p in second}) == 1
        k2 = rng.randint(0, len(second[0]))
        t = _sampler(sizes, 0, w2, **kw)
        t.load_state_dict(state)
        t.advance(k2)
        state2 = t.state_dict()
        read += [i for p in second for i in p[:k2]]
        third = []
        for r in range(w3):
            u = _sampler(sizes, r, w3, **kw)
            u.load_state_dict(state2)
            third.append(list(u))
        assert len({len(p) for p in third}) == 1
        counts = collections.Counter(read + [i for p in third for i in p])
        if kw["drop_last"]:
            assert max(counts.values(), default=1) == 1
        elif k1 * w1 + k2 * w2 < n:
            assert set(counts) == set(range(n))
            assert sum(counts.values()) - n < w1 + w2 + w3  # only end-of-epoch padding repeats


def _shards_of(sizes, samples) -> set[int]:
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return set((np.searchsorted(starts, np.asarray(samples), side="right") - 1).tolist())


def test_each_rank_reads_about_its_share_of_the_shards():
    sizes, world, window = [100] * 1000, 8, 4
    per_rank = [_shards_of(sizes, p) for p in _epoch(sizes, world, window_shards=window)]
    for shards in per_rank:
        assert len(shards) <= 1000 / world + 2 * window  # its block, + windows shared at its two ends
    assert sum(len(s) for s in per_rank) <= 1000 + (world - 1) * window  # each shard read by about one rank
    first = list(itertools.islice(_sampler(sizes, 5, world, window_shards=window), 400))  # one window of samples
    assert len(_shards_of(sizes, first)) <= 2 * window  # a few shards at a time
    glob = [_shards_of(sizes, p) for p in _epoch(sizes, world, shuffle="global")]
    assert min(len(s) for s in glob) > 900  # the global order: every rank touches nearly every shard


def test_schedule_lists_the_shards_in_order_of_first_use():
    s = _sampler(UNEVEN, 1, 3, window_shards=2)
    s.advance(4)
    samples = list(s)
    sched = list(s.shard_schedule())
    by_use = []
    starts = np.concatenate([[0], np.cumsum(UNEVEN)[:-1]])
    for shard in (np.searchsorted(starts, samples, side="right") - 1).tolist():
        if shard not in by_use:
            by_use.append(shard)
    assert [x[0] for x in sched] == by_use
    for shard, first, last in sched:
        assert _shards_of(UNEVEN, [samples[first]]) == {shard} == _shards_of(UNEVEN, [samples[last]])


def test_memory_and_time_do_not_grow_with_the_sample_count():
    sizes = np.full(100_000, 10_000)  # 10^9 virtual samples
    tracemalloc.start()
    try:
        t0 = time.perf_counter()
        s = ResumableSampler(10**9, seed=0, rank=3, world_size=8, shard_sizes=sizes)
        first = list(itertools.islice(iter(s), 1000))
        s.advance(60_000_000)  # resume at another world size, mid-epoch, at that scale
        state = s.state_dict()
        t = ResumableSampler(10**9, seed=0, rank=4, world_size=6, shard_sizes=sizes)
        t.load_state_dict(state)
        more = list(itertools.islice(iter(t), 1000))
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(set(first)) == 1000 and len(set(more)) == 1000
    assert peak < 100 << 20, f"peak {peak / 2**20:.0f} MiB"
    assert elapsed < 2.0, f"{elapsed:.2f} s"  # about 0.3 s here; generous for a loaded box
    assert len(t.segments) == 8 and len(_shards_of(sizes, first)) <= 8  # the rest of 8 blocks; 2 windows at most


def test_global_mode_is_the_order_of_before():
    n, world, seed = 103, 4, 9
    perm = np.random.default_rng([seed, 2]).permutation(n)
    for shard_sizes in (None, UNEVEN + [103 - sum(UNEVEN)]):
        mode = "global" if shard_sizes is not None else True  # True without shards: global, as before
        for r in range(world):
            s = ResumableSampler(n, seed=seed, shuffle=mode, rank=r, world_size=world, shard_sizes=shard_sizes)
            s.set_epoch(2)
            assert s.mode == "global"
            assert list(s) == [int(perm[p % n]) for p in range(r, 104, world)]
    assert list(ResumableSampler(10, shuffle=False, rank=0, world_size=1, shard_sizes=[4, 6])) == list(range(10))
    with pytest.raises(ConfigError, match="shard_sizes"):
        ResumableSampler(10, shuffle="shards", rank=0, world_size=1)
    with pytest.raises(ConfigError, match="one of"):
        ResumableSampler(10, shuffle="blocks", rank=0, world_size=1)


def test_an_old_state_resumes_its_epoch_in_its_own_order():
    n = sum(UNEVEN)
    old = {"version": 1, "epoch": 2, "position": 12, "seed": 5, "num_samples": n, "world_size": 2, "shuffle": True}
    s = _sampler(UNEVEN, 1, 2)  # configured for blocks
    s.load_state_dict(old)
    ref = ResumableSampler(n, seed=5, rank=1, world_size=2)  # what the old release would read
    ref.set_epoch(2)
    ref.advance(6)
    assert s.epoch_mode == "global" and list(s) == list(ref)
    assert s.state_dict()["shuffle"] == "global"
    s.set_epoch(3)  # the next epoch is block-shuffled
    assert s.epoch_mode == "shards" and list(s) == list(_next(UNEVEN, 5, 3))
    s.load_state_dict(old | {"shuffle": False})
    assert s.epoch_mode == "none"
    with pytest.raises(ConfigError, match="version 3"):
        s.load_state_dict(old | {"version": 3})
    blocks = _sampler(UNEVEN, 0, 2).state_dict()
    with pytest.raises(ConfigError, match="dataset changed"):
        _sampler(UNEVEN[:-2] + [UNEVEN[-2] + UNEVEN[-1], 0], 0, 2).load_state_dict(blocks)


def _next(sizes, seed, epoch):
    s = _sampler(sizes, 1, 2, seed=seed)
    s.set_epoch(epoch)
    return s


def test_loader_uses_blocks_for_a_sharded_dataset(numbered):
    ds = ShardedDataset(numbered)
    loader = SlipstreamLoader(ds, batch_size=10, seed=1, rank=1, world_size=2)
    state = loader.state_dict()
    assert state["shuffle"] == "shards" and state["num_shards"] == ds.num_shards
    ids = [int(r[0]) for b in loader for r in b]
    assert ids == list(_sampler([i.num_samples for i in ds.index.shards], 1, 2, seed=1))
    assert SlipstreamLoader(ds, batch_size=10, shuffle="global", rank=0, world_size=1).state_dict()["shuffle"] == "global"
