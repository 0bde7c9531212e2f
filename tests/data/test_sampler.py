"""Resumable sampling: determinism, rank sharding, exact mid-epoch resume (workers), world-size change."""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest
import torch.utils.data

from slipstream.data import ResumableSampler, ShardedDataset, SlipstreamLoader
from slipstream.errors import ConfigError
from tests.conftest import need_module


def test_order_is_deterministic_per_seed_and_epoch():
    a = ResumableSampler(1000, seed=7, rank=0, world_size=1)
    b = ResumableSampler(1000, seed=7, rank=0, world_size=1)
    e0 = list(a)
    assert e0 == list(b) and sorted(e0) == list(range(1000))
    a.set_epoch(1)
    e1 = list(a)
    assert e1 != e0 and sorted(e1) == list(range(1000))
    assert list(ResumableSampler(1000, seed=8, rank=0, world_size=1)) != e0
    a.set_epoch(0)
    assert list(a) == e0
    assert list(ResumableSampler(10, shuffle=False, rank=0, world_size=1)) == list(range(10))


def test_epoch_loop_semantics(ds):
    loader = SlipstreamLoader(ds, batch_size=50, seed=1, rank=0, world_size=1)
    e0 = _run(loader)
    assert loader.state_dict()["epoch"] == 1
    loader.set_epoch(0)  # asking for a finished epoch again replays it
    assert _run(loader) == e0
    loader.set_epoch(1)
    e1 = _run(loader)
    assert _run(loader) != e1  # a plain second loop moves on to epoch 2
    assert loader.state_dict()["epoch"] == 3


@pytest.mark.parametrize("n,world,drop_last", [(100, 4, False), (103, 4, False), (103, 4, True), (5, 3, False)])
def test_ranks_split_the_epoch(n, world, drop_last):
    parts = [list(ResumableSampler(n, seed=1, rank=r, world_size=world, drop_last=drop_last)) for r in range(world)]
    assert len({len(p) for p in parts}) == 1  # equal lengths keep DDP ranks in step
    counts = collections.Counter(i for p in parts for i in p)
    if drop_last:
        assert len(counts) == n - n % world and max(counts.values()) == 1
    else:
        assert set(counts) == set(range(n))
        assert sum(counts.values()) - n == (-n) % world  # only the wrap-around padding repeats
    assert len(parts[0]) == len(ResumableSampler(n, seed=1, rank=0, world_size=world, drop_last=drop_last))


def test_rank_from_torch_distributed_defaults_and_checks():
    s = ResumableSampler(10)  # no process group: rank 0 of 1
    assert (s.rank, s.world_size) == (0, 1)
    with pytest.raises(ConfigError, match="rank"):
        ResumableSampler(10, rank=2, world_size=2)


@pytest.fixture
def ds(numbered):
    return ShardedDataset(numbered)  # 200 samples, row i == i


def _ids(batch) -> list[int]:
    return [int(r[0]) for r in batch]


def _run(loader, batches=None) -> list[list[int]]:
    out = []
    for b in loader:
        out.append(_ids(b))
        if batches is not None and len(out) == batches:
            break
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_mid_epoch(ds, num_workers):
    kw = dict(batch_size=6, seed=11, rank=0, world_size=1, num_workers=num_workers)
    ref_loader = SlipstreamLoader(ds, **kw)
    ref = _run(ref_loader) + _run(ref_loader)  # two epochs (the loader moves on by itself)
    assert len(ref) == 2 * 34 and ref[0] != ref[34]

    first = SlipstreamLoader(ds, **kw)
    head = _run(first, batches=13)
    state = first.state_dict()
    assert state["epoch"] == 0 and state["position"] == 13 * 6
    first.close()

    resumed = SlipstreamLoader(ds, **kw)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # what a training loop does; must not rewind
    tail = _run(resumed)
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["position"] == 0
    assert head + tail == ref[:34]
    more = _run(resumed, batches=20)
    state2 = resumed.state_dict()
    assert (state2["epoch"], state2["position"]) == (1, 20 * 6)
    again = SlipstreamLoader(ds, **kw)
    again.load_state_dict(state2)
    assert more + _run(again) == ref[34:]


def test_resume_after_a_batch_in_flight_in_the_prefetch_queue(ds):
    # The workers and the prefetch thread read ahead; the state counts only what the loop got.
    loader = SlipstreamLoader(ds, batch_size=4, seed=2, rank=0, world_size=1, num_workers=2, prefetch_batches=4)
    it = iter(loader)
    got = [_ids(next(it)) for _ in range(3)]
    deadline = time.monotonic() + 30  # until they have run ahead: the prefetch queue full
    while it._queue.qsize() < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert it._queue.qsize() == 4, "the prefetch never ran ahead"
    state = loader.state_dict()
    assert state["position"] == 12
    other = SlipstreamLoader(ds, batch_size=4, seed=2, rank=0, world_size=1)
    other.load_state_dict(state)
    ref = _run(SlipstreamLoader(ds, batch_size=4, seed=2, rank=0, world_size=1))
    assert got + _run(other) == ref
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_loaded_into_a_running_loop_rewinds_it(ds, num_workers):
    # Healing in place restores a snapshot while `for batch in loader` runs: the same loop goes on
    # from the restored position (prefetched batches dropped), as a resumed run would.
    kw = dict(batch_size=6, seed=5, rank=0, world_size=1, num_workers=num_workers, prefetch_batches=3)
    ref = _run(SlipstreamLoader(ds, **kw))
    loader = SlipstreamLoader(ds, **kw)
    got, state, rewound = [], None, False
    for batch in loader:
        got.append(_ids(batch))
        if len(got) == 5:
            state = loader.state_dict()
        if len(got) == 9 and not rewound:
            rewound = True
            del got[5:]
            loader.load_state_dict(state)
    assert got == ref
    loader.close()


def _ranks_take(ds, world, batches, state=None, batch_size=5, seed=4):
    loaders = [SlipstreamLoader(ds, batch_size=batch_size, seed=seed, rank=r, world_size=world) for r in range(world)]
    if state is not None:
        for ld in loaders:
            ld.load_state_dict(state)
    taken = [[i for b in _run(ld, batches) for i in b] for ld in loaders]
    states = [ld.state_dict() for ld in loaders]
    return taken, states


def test_world_size_change_keeps_position_and_resplits(ds):
    n = len(ds)
    taken2, states = _ranks_take(ds, world=2, batches=7)
    assert all(s == states[0] for s in states) and states[0]["position"] == 2 * 7 * 5
    before = [i for t in taken2 for i in t]
    assert len(set(before)) == len(before) == 70

    taken3, states3 = _ranks_take(ds, world=3, batches=None, state=states[0])
    after = [i for t in taken3 for i in t]
    assert len({len(t) for t in taken3}) == 1
    counts = collections.Counter(before + after)
    assert set(counts) == set(range(n))  # every sample of the epoch, and...
    repeats = sum(counts.values()) - n
    assert repeats == (-(n - 70)) % 3  # ...only the end-of-epoch padding for 3 ranks repeats
    assert len(set(after)) == len(after)  # nothing twice after the change
    assert len(set(before) & set(after)) == repeats  # the padding wraps to the epoch's first samples
    assert states3[0]["epoch"] == 1 and states3[0]["position"] == 0

    # The next epoch's order does not depend on the world size.
    s = ResumableSampler(n, seed=4, rank=0, world_size=1)
    s.set_epoch(1)
    one = list(s)
    parts = []
    for r in range(3):
        t = ResumableSampler(n, seed=4, rank=r, world_size=3)
        t.set_epoch(1)
        parts.append(list(t))
    interleaved = [p[k] for k in range(len(parts[0])) for p in parts][:n]
    assert interleaved == one


def test_state_for_another_dataset_is_refused(ds):
    s = ResumableSampler(len(ds) + 1, rank=0, world_size=1).state_dict()
    with pytest.raises(ConfigError, match="dataset changed"):
        SlipstreamLoader(ds, batch_size=2, rank=0, world_size=1).load_state_dict(s)
    bad = ResumableSampler(len(ds), rank=0, world_size=2).state_dict() | {"position": len(ds) + 2}
    with pytest.raises(ConfigError, match="outside"):
        SlipstreamLoader(ds, batch_size=2, rank=0, world_size=1).load_state_dict(bad)


class _Slow(torch.utils.data.Dataset):
    def __init__(self, n: int, delay_s: float):
        self.n, self.delay_s = n, delay_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return np.int64(i)


def test_prefetch_overlaps_reading_with_compute():
    # 4 samples x 10 ms to read a batch, 60 ms of "compute" per step: with the
    # background thread the loop should barely wait; without it, it waits ~40 ms a step.
    steps, compute_s = 8, 0.06

    def run(prefetch_batches):
        loader = SlipstreamLoader(_Slow(steps * 4, 0.01), batch_size=4, shuffle=False, rank=0, world_size=1, prefetch_batches=prefetch_batches)
        waits = []
        for _ in loader:
            waits.append(loader.last_wait_s)
            time.sleep(compute_s)
        assert len(waits) == steps and loader.wait_s_total >= sum(waits) - 1e-9
        return waits

    sync = run(0)
    bg = run(2)
    assert min(sync) > 0.03
    assert sum(bg[1:]) < 0.5 * sum(sync[1:]), (bg, sync)
    assert {"data_wait_s", "data_wait_s_total", "data_skipped_total"} <= set(
        SlipstreamLoader(_Slow(4, 0), batch_size=2, rank=0, world_size=1).stats()
    )


def _dist_rank(store_path, rank, world, ds_dir, queue):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        loader = SlipstreamLoader(ShardedDataset(ds_dir), batch_size=8, seed=5)  # rank/world from the group
        ids = [int(r[0]) for b in loader for r in b]
        queue.put((rank, loader.sampler.rank, loader.sampler.world_size, ids))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_rank_and_world_size_come_from_torch_distributed(tmp_path, numbered):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_dist_rank, args=(str(tmp_path / "store"), r, 2, numbered, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert [(r, sr, w) for r, sr, w, _ in out] == [(0, 0, 2), (1, 1, 2)]
    a, b = out[0][3], out[1][3]
    assert len(a) == len(b) == 100 and not set(a) & set(b) and set(a) | set(b) == set(range(200))


hypothesis = need_module("hypothesis", "a test tool: bash scripts/install.sh test")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    world=st.integers(1, 6),
    new_world=st.integers(1, 6),
    frac=st.floats(0, 1),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
)
def test_resume_properties(n, world, new_world, frac, seed, epoch):
    """Same W: the rest is exactly what would have come. New W: the epoch is covered exactly once (+ padding)."""
    full = []
    for r in range(world):
        s = ResumableSampler(n, seed=seed, rank=r, world_size=world)
        s.set_epoch(epoch)
        full.append(list(s))
    per_rank = len(full[0])
    k = int(frac * per_rank)
    state = None
    for r in range(world):
        s = ResumableSampler(n, seed=seed, rank=r, world_size=world)
        s.set_epoch(epoch)
        s.advance(k)
        state = s.state_dict()
        t = ResumableSampler(n, seed=0, rank=r, world_size=world)
        t.load_state_dict(state)
        assert full[r][:k] + list(t) == full[r]
    consumed = [i for r in range(world) for i in full[r][:k]]
    rest = []
    for r in range(new_world):
        t = ResumableSampler(n, seed=0, rank=r, world_size=new_world)
        t.load_state_dict(state)
        rest.append(list(t))
    assert len({len(x) for x in rest}) == 1
    counts = collections.Counter(consumed + [i for x in rest for i in x])
    if k * world < n:
        assert set(counts) == set(range(n))
    pad = sum(counts.values()) - len(counts)
    assert pad < max(world, new_world)
