"""Object store (moto's S3 server on loopback) -> node cache: prewarm, hits, eviction, races, checksums."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from slipstream.data import (
    DataIntegrityError,
    ShardCache,
    ShardedDataset,
    SlipstreamLoader,
    load_index,
    pack_arrays,
    prewarm,
)
from slipstream.data.source import Source
from slipstream.errors import ConfigError

from .conftest import numbered_arrays

N, WIDTH = 120, 64
SHARD_BYTES = 10 * 8 * WIDTH + 400  # about 10 samples per shard


@pytest.fixture
def remote(tmp_path, s3):
    """A 120-sample dataset (row i == i) packed straight into a fresh bucket."""
    url, opts, client = s3
    src = str(tmp_path / "rows.npy")
    numbered_arrays(src, N, WIDTH)
    ds_url = f"{url}/rows"
    idx = pack_arrays(src, ds_url, shard_size_bytes=SHARD_BYTES, storage_options=opts)
    assert len(idx.shards) >= 10
    return ds_url, opts, client, idx


def _all_rows(ds) -> list[int]:
    out = []
    for i in range(len(ds)):
        row = ds[i]
        assert (row == row[0]).all()
        out.append(int(row[0]))
    return out


def _blobs(cache_dir) -> list[str]:
    return sorted(os.listdir(os.path.join(cache_dir, "blobs")))


def test_remote_needs_a_cache(remote):
    ds_url, opts, _, _ = remote
    with pytest.raises(ConfigError, match="pass cache="):
        ShardedDataset(ds_url, storage_options=opts)


def test_prewarm_then_cache_hits_without_the_store(tmp_path, remote):
    ds_url, opts, client, idx = remote
    cache = ShardCache(tmp_path / "cache")
    report = prewarm(ds_url, cache, workers=4, storage_options=opts, progress=False)
    assert report.shards == len(idx.shards) == report.downloaded and report.already_cached == 0
    assert report.bytes_downloaded == idx.total_bytes
    assert _blobs(cache.dir) == sorted(f"{s.sha256}.slp" for s in idx.shards)
    assert os.listdir(os.path.join(cache.dir, "tmp")) == []

    # Delete every shard from the bucket: reads can only be served by the cache now.
    bucket, prefix = ds_url[len("s3://") :].split("/", 1)
    for s in idx.shards:
        client.delete_object(Bucket=bucket, Key=f"{prefix}/{s.file}")
    cache2 = ShardCache(tmp_path / "cache")  # a fresh process would see the same
    ds = ShardedDataset(ds_url, cache=cache2, storage_options=opts)
    assert _all_rows(ds) == list(range(N))
    assert cache2.stats.downloads == 0 and cache2.stats.hits == len(idx.shards)

    again = prewarm(ds_url, cache2, workers=4, storage_options=opts, progress=False)
    assert again.downloaded == 0 and again.already_cached == len(idx.shards)

    # and without the cache the deleted shards really are gone
    with pytest.raises(FileNotFoundError):
        ShardCache(tmp_path / "other").fetch(Source(ds_url, opts), idx.shards[0])


def test_read_through_on_first_use_and_mtime_unchanged_on_hit(tmp_path, remote):
    ds_url, opts, _, idx = remote
    cache = ShardCache(tmp_path / "cache")
    ds = ShardedDataset(ds_url, cache=cache, storage_options=opts)
    assert ds[0][0] == 0 and cache.stats.downloads == 1
    blob = cache.blob_path(idx.shards[0].sha256)
    ino = os.stat(blob).st_ino
    ds2 = ShardedDataset(ds_url, cache=cache, storage_options=opts)
    assert ds2[1][0] == 1
    assert cache.stats.downloads == 1 and cache.stats.hits == 1 and os.stat(blob).st_ino == ino


def test_damaged_cached_copy_is_fetched_again(tmp_path, remote):
    ds_url, opts, _, idx = remote
    cache = ShardCache(tmp_path / "cache")
    prewarm(ds_url, cache, workers=2, storage_options=opts, progress=False)
    blob = cache.blob_path(idx.shards[0].sha256)
    with open(blob, "r+b") as f:
        f.truncate(100)
    cache = ShardCache(tmp_path / "cache")
    ds = ShardedDataset(ds_url, cache=cache, storage_options=opts)
    assert int(ds[3][0]) == 3
    assert cache.stats.checksum_failures == 1 and cache.stats.downloads == 1
    assert os.path.getsize(blob) == idx.shards[0].size_bytes


def test_lru_eviction_under_the_size_limit(tmp_path, remote):
    ds_url, opts, _, idx = remote
    sizes = {s.size_bytes for s in idx.shards[:5]}
    size = max(sizes)
    cache = ShardCache(tmp_path / "cache", max_bytes=int(2.5 * size))
    src = Source(ds_url, opts)
    s0, s1, s2, s3 = idx.shards[:4]
    for s in (s0, s1):
        cache.fetch(src, s)
        time.sleep(0.01)
    cache.fetch(src, s2)  # third does not fit: evicts the least recently used, s0
    assert not cache.contains(s0) and cache.contains(s1) and cache.contains(s2)
    time.sleep(0.01)
    cache.fetch(src, s1)  # a hit makes s1 the most recently used
    time.sleep(0.01)
    cache.fetch(src, s3)  # so s2 goes now
    assert cache.contains(s1) and cache.contains(s3) and not cache.contains(s2)
    assert cache.used_bytes() <= cache.max_bytes
    assert cache.stats.evictions == 2 and cache.stats.hits == 1 and cache.stats.downloads == 4

    # A dataset much larger than the cache still reads correctly, within the limit.
    ds = ShardedDataset(ds_url, cache=cache, storage_options=opts)
    assert _all_rows(ds) == list(range(N))
    assert cache.used_bytes() <= cache.max_bytes
    with pytest.raises(ConfigError, match="does not fit"):
        ShardCache(tmp_path / "tiny", max_bytes=size // 2).fetch(src, s0)


def test_leftovers_of_dead_processes_are_cleaned(tmp_path, remote):
    import subprocess
    import sys

    from slipstream.data import cache as cache_mod

    ds_url, opts, _, idx = remote
    size = max(s.size_bytes for s in idx.shards)
    cache = ShardCache(tmp_path / "cache", max_bytes=2 * size)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tdir = tmp_path / "cache" / "tmp"
    # a crashed download and its reservation (as large as the whole cache), from a dead pid here
    (tdir / f"{'0' * 64}.{dead.pid}.0.{cache_mod._HOST_ID}").write_bytes(b"partial")
    (tdir / f"{'0' * 64}.{dead.pid}.1.{cache_mod._HOST_ID}.reserve-{2 * size}").touch()
    # another host's fresh reservation stays (its pid means nothing here), an old one goes
    (tdir / f"{'1' * 64}.1.0.otherhost.reserve-1").touch()
    old = tdir / f"{'2' * 64}.1.0.otherhost.reserve-1"
    old.touch()
    os.utime(old, (time.time() - 2 * cache_mod.STALE_TMP_S,) * 2)
    cache.fetch(Source(ds_url, opts), idx.shards[0])  # would wait for room forever without the cleanup
    assert sorted(os.listdir(tdir)) == [f"{'1' * 64}.1.0.otherhost.reserve-1"]


def _reader(cache_dir, ds_url, opts, barrier, queue):
    cache = ShardCache(cache_dir)
    ds = ShardedDataset(ds_url, cache=cache, storage_options=opts)
    barrier.wait(timeout=60)
    h = hashlib.sha256()
    for i in range(len(ds)):
        h.update(ds[i].tobytes())
    queue.put((cache.stats.downloads, cache.stats.hits, h.hexdigest()))


def test_concurrent_processes_fill_the_cache_once(tmp_path, remote):
    ds_url, opts, _, idx = remote
    ctx = mp.get_context("fork")
    nproc = 3
    barrier, queue = ctx.Barrier(nproc), ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(str(tmp_path / "cache"), ds_url, opts, barrier, queue)) for _ in range(nproc)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in range(nproc)]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    ref = hashlib.sha256(np.repeat(np.arange(N, dtype=np.int64)[:, None], WIDTH, axis=1).tobytes()).hexdigest()
    assert [r[2] for r in results] == [ref] * nproc
    assert sum(r[0] for r in results) == len(idx.shards)  # each shard downloaded exactly once
    assert sum(r[0] + r[1] for r in results) == nproc * len(idx.shards)
    assert _blobs(tmp_path / "cache") == sorted(f"{s.sha256}.slp" for s in idx.shards)
    assert os.listdir(tmp_path / "cache" / "tmp") == []


def test_loader_workers_share_the_cache(tmp_path, remote):
    ds_url, opts, _, idx = remote
    ds = ShardedDataset(ds_url, cache=ShardCache(tmp_path / "cache"), storage_options=opts)
    loader = SlipstreamLoader(ds, batch_size=8, seed=3, num_workers=2, rank=0, world_size=1)
    got = sorted(int(r[0]) for b in loader for r in b)
    assert got == list(range(N))
    assert len(_blobs(tmp_path / "cache")) == len(idx.shards)


@pytest.mark.parametrize("fetch_ahead", [0, 3])
def test_fetch_ahead_downloads_the_coming_shards(tmp_path, remote, fetch_ahead):
    ds_url, opts, _, idx = remote
    cache = ShardCache(tmp_path / "cache")
    ds = ShardedDataset(ds_url, cache=cache, storage_options=opts)
    loader = SlipstreamLoader(ds, batch_size=2, seed=9, rank=0, world_size=1, prefetch_batches=0, fetch_ahead=fetch_ahead)
    it = iter(loader)
    first = next(it)  # touches at most 2 shards by itself
    deadline = time.monotonic() + 30
    while fetch_ahead and len(_blobs(cache.dir)) < len(idx.shards) and time.monotonic() < deadline:
        time.sleep(0.05)
    if fetch_ahead:
        assert len(_blobs(cache.dir)) == len(idx.shards)
        assert loader._fetcher.planned == len(idx.shards) and loader._fetcher.failed == 0
    else:
        time.sleep(0.3)
        assert len(_blobs(cache.dir)) <= 2
    rows = sorted(int(r[0]) for b in [first, *it] for r in b)
    assert rows == list(range(N))
    assert cache.stats.downloads == len(idx.shards)  # fetching ahead never downloads a shard twice
    loader.close()


@pytest.mark.parametrize("shuffle", ["shards", "global"])
def test_fetch_ahead_stays_within_the_cache_limit(tmp_path, remote, shuffle):
    # "shards": the shards held (in use or fetched ahead) stay within the cache and
    # are released as windows finish, so every shard is fetched ahead over the epoch.
    # "global": nothing is released before the epoch ends, so half the cache, once.
    ds_url, opts, _, idx = remote
    size = max(s.size_bytes for s in idx.shards)
    cache = ShardCache(tmp_path / "cache", max_bytes=6 * size)
    ds = ShardedDataset(ds_url, cache=cache, storage_options=opts)
    loader = SlipstreamLoader(ds, batch_size=2, seed=9, shuffle=shuffle, rank=0, world_size=1, prefetch_batches=0, fetch_ahead=2)
    rows = []
    for b in loader:
        rows += [int(r[0]) for r in b]
        assert cache.used_bytes() <= cache.max_bytes
    assert sorted(rows) == list(range(N))
    fetcher = loader._fetcher
    want = 3 if shuffle == "global" else len(idx.shards)
    deadline = time.monotonic() + 30
    while fetcher.planned < want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fetcher.planned == want and fetcher.failed == 0
    assert fetcher.held_bytes_max <= fetcher.budget_bytes == (6 * size if shuffle == "shards" else 3 * size)
    assert cache.used_bytes() <= cache.max_bytes
    loader.close()


def test_checksum_failure_on_arrival(tmp_path, remote):
    ds_url, opts, client, idx = remote
    bucket, prefix = ds_url[len("s3://") :].split("/", 1)
    bad = idx.shards[2]
    key = f"{prefix}/{bad.file}"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[100] ^= 0xFF  # same size, one flipped byte
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    cache = ShardCache(tmp_path / "cache", retries=1)
    with pytest.raises(DataIntegrityError) as ei:
        prewarm(ds_url, cache, workers=4, storage_options=opts, progress=False)
    msg = str(ei.value)
    assert f"{ds_url}/{bad.file}" in msg and "sha256" in msg and bad.sha256 in msg
    assert cache.stats.checksum_failures == 2  # first try and one retry
    assert not cache.contains(bad)
    assert os.listdir(os.path.join(cache.dir, "tmp")) == []

    client.put_object(Bucket=bucket, Key=key, Body=bytes(body[:-500]))  # truncated object
    with pytest.raises(DataIntegrityError, match=rf"truncated at byte offset {bad.size_bytes - 500}"):
        cache.fetch(Source(ds_url, opts), bad)

    # skip mode: the loader skips that shard's samples, counts them, returns the rest intact
    ds = ShardedDataset(ds_url, cache=cache, storage_options=opts, on_error="skip")
    loader = SlipstreamLoader(ds, batch_size=16, shuffle=False, rank=0, world_size=1)
    rows = [int(r[0]) for b in loader for r in b]
    lo, hi = int(idx.starts()[2]), int(idx.starts()[3])
    assert rows == [i for i in range(N) if not lo <= i < hi]
    assert loader.skipped_total == hi - lo


def _dead_endpoint_opts():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # nothing listens on that port now; one attempt, so the test does not sit in retries
    return {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing",
            "config_kwargs": {"retries": {"max_attempts": 1}}, "skip_instance_cache": True}


def test_store_unreachable_uses_the_kept_index_and_cached_shards(tmp_path, remote):
    from slipstream.data.source import SourceUnavailable

    ds_url, opts, _, idx = remote
    dead = _dead_endpoint_opts()
    with pytest.raises(SourceUnavailable, match=rf"cannot read {ds_url}/index.json"):
        ShardedDataset(ds_url, cache=ShardCache(tmp_path / "empty"), storage_options=dead)
    cache = ShardCache(tmp_path / "cache")
    prewarm(ds_url, cache, workers=2, storage_options=opts, progress=False)
    cache = ShardCache(tmp_path / "cache")
    with pytest.warns(UserWarning, match="using the copy of its index"):
        ds = ShardedDataset(ds_url, cache=cache, storage_options=dead)
    assert _all_rows(ds) == list(range(N)) and cache.stats.index_fallbacks == 1
    # a shard that is not cached cannot be read from a dead store: a clear error, not a hang
    os.remove(cache.blob_path(idx.shards[-1].sha256))
    with pytest.warns(UserWarning), pytest.raises(SourceUnavailable, match=idx.shards[-1].file):
        ShardedDataset(ds_url, cache=cache, storage_options=dead)[N - 1]


def test_index_is_loaded_from_the_store(remote):
    ds_url, opts, _, idx = remote
    assert load_index(Source(ds_url, opts)).to_json() == idx.to_json()
