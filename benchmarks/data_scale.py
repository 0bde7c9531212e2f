"""Data order at scale: the sampler's memory and start-up time, and bytes fetched per rank.

    python benchmarks/data_scale.py sampler            # (a) 10^7, 10^8, 10^9 virtual samples
    python benchmarks/data_scale.py fetch              # (b) one epoch, 2 ranks, through a small node cache
    python benchmarks/data_scale.py all

(a) For each order and size, in a fresh process (so memory is that order's
alone): the time from constructing the sampler to its first 1000 indices
(rank 3 of 8), the RSS growth over that (peak ``ru_maxrss`` minus the RSS
before), and, in a second process, the tracemalloc peak. Shards of 10^4
samples (10^5 shards at 10^9). Orders: "shards" (block shuffle, window of 4
shards), "global" (one permutation, iterated in chunks), and "global, before"
(the sampler of the commit before block shuffling: permutation +
``positions().tolist()``), loaded from git. The global orders are not run at
10^9 (8 GB for the permutation alone, on a shared 24 GiB box): extrapolate.

(b) A dataset packed into moto's S3 server (its own process, 127.0.0.1), read
for one epoch by 2 ranks, each a "node" with its own ShardCache limited to
1/10 of the dataset, through SlipstreamLoader (num_workers=0, fetch_ahead=2).
Reported per rank: bytes downloaded against its share (dataset / 2), shards
downloaded, evictions, and the epoch's wall time. The ranks run one after the
other in this process (the figures are per node, so this changes nothing but
the wall time). With num_workers=0 the one reading process keeps every shard
it opened mapped, so a shard evicted from the cache's disk is not downloaded
again by that process; the global order's bytes are the whole dataset per
node even so. (With worker processes, each maps shards itself, and the cache's
counters are per process: not measured here.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BEFORE = "91298c7~1"  # the commit before block shuffling
SAMPLES_PER_SHARD = 10_000


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _old_sampler_class(work: Path):
    src = subprocess.run(["git", "show", f"{BEFORE}:src/slipstream/data/sampler.py"], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    src = src.replace("from ..errors import ConfigError", "from slipstream.errors import ConfigError")
    path = work / "old_sampler.py"
    path.write_text(src)
    sys.path.insert(0, str(work))
    import old_sampler

    return old_sampler.ResumableSampler


def one(mode: str, n: int, trace: bool) -> dict:
    """Time and memory to the first 1000 indices of rank 3 of 8 (run in a fresh process)."""
    from slipstream.data import ResumableSampler

    cls = ResumableSampler
    if mode == "global-before":
        cls = _old_sampler_class(Path(tempfile.mkdtemp(prefix="slipstream-old-sampler-")))
    sizes = np.full(n // SAMPLES_PER_SHARD, SAMPLES_PER_SHARD)
    if trace:
        tracemalloc.start()
    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    if mode == "global-before":
        s = cls(n, seed=0, rank=3, world_size=8)
    else:
        s = cls(n, seed=0, rank=3, world_size=8, shuffle=mode, shard_sizes=sizes)
    first = list(itertools.islice(iter(s), 1000))
    dt = time.perf_counter() - t0
    out = {"mode": mode, "n": n, "first_1000_s": dt, "rss_growth_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0}
    if trace:
        out["tracemalloc_peak_bytes"] = tracemalloc.get_traced_memory()[1]
    assert len(set(first)) == 1000
    return out


def bench_sampler(sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    for n in sizes:
        for mode in ("shards", "global", "global-before"):
            if mode != "shards" and n > 10**8:
                rows.append({"mode": mode, "n": n, "skipped": "not run: 8 bytes per sample for the permutation alone"})
                continue
            times, rss = [], []
            for _ in range(repeats):
                r = _child(mode, n, trace=False)
                times.append(r["first_1000_s"])
                rss.append(r["rss_growth_bytes"])
            traced = _child(mode, n, trace=True)
            rows.append({"mode": mode, "n": n, "first_1000_s": sorted(times)[len(times) // 2], "all_s": times,
                         "rss_growth_bytes": sorted(rss)[len(rss) // 2], "tracemalloc_peak_bytes": traced["tracemalloc_peak_bytes"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _child(mode: str, n: int, trace: bool) -> dict:
    cmd = [sys.executable, __file__, "one", mode, str(n)] + (["--trace"] if trace else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- (b) bytes per rank


def bench_fetch(args) -> list[dict]:
    import boto3

    from data_bench import free_port, start_moto
    from slipstream.data import ShardCache, ShardedDataset, ShardWriter, SlipstreamLoader

    work = Path(tempfile.mkdtemp(prefix="slipstream-data-scale-"))
    port = free_port()
    moto = start_moto(port)
    rows = []
    try:
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket="bench")
        local = work / "ds"
        rng = np.random.default_rng(0)
        with ShardWriter(local, shard_size_bytes=args.shard_kb << 10, fields=[("x", "uint8", (args.sample_bytes,))]) as w:
            for _ in range(args.shards * ((args.shard_kb << 10) // (args.sample_bytes + 32))):
                w.write(rng.integers(0, 256, args.sample_bytes, dtype=np.uint8))
        index = w.index
        names = sorted(os.listdir(local), key=lambda f: f == "index.json")  # the index last
        for f in names:
            client.upload_file(str(local / f), "bench", f"ds/{f}")
        total = index.total_bytes
        cache_bytes = total // args.cache_fraction
        print(f"# dataset: {len(index.shards)} shards, {index.num_samples} samples, {total / 1e6:.1f} MB; "
              f"node cache {cache_bytes / 1e6:.2f} MB (1/{args.cache_fraction})", flush=True)
        opts = {"endpoint_url": endpoint}
        for mode in ("shards", "global"):
            for rank in range(args.world):
                cache = ShardCache(work / f"cache-{mode}-{rank}", max_bytes=cache_bytes)
                ds = ShardedDataset("s3://bench/ds", cache=cache, storage_options=opts)
                loader = SlipstreamLoader(ds, batch_size=32, seed=0, shuffle=mode, rank=rank, world_size=args.world,
                                          prefetch_batches=0, fetch_ahead=args.fetch_ahead)
                t0 = time.perf_counter()
                n = sum(len(b) for b in loader)
                dt = time.perf_counter() - t0
                fetcher = loader._fetcher
                if fetcher is not None:
                    fetcher.close()
                    fetcher._pool.shutdown(wait=True)
                st = cache.stats
                rows.append({"mode": mode, "rank": rank, "samples": n, "bytes_downloaded": st.bytes_downloaded,
                             "share_bytes": total / args.world, "ratio_to_share": st.bytes_downloaded / (total / args.world),
                             "downloads": st.downloads, "evictions": st.evictions, "epoch_s": dt})
                print(json.dumps(rows[-1]), flush=True)
                loader.close()
    finally:
        moto.kill()
        moto.wait()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["sampler", "fetch", "all", "one"])
    p.add_argument("mode", nargs="?")
    p.add_argument("n", nargs="?", type=int)
    p.add_argument("--trace", action="store_true")
    p.add_argument("--sizes", default="10000000,100000000,1000000000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--shards", type=int, default=100)
    p.add_argument("--shard-kb", type=int, default=128)
    p.add_argument("--sample-bytes", type=int, default=1000)
    p.add_argument("--cache-fraction", type=int, default=10, help="the node cache is dataset / this")
    p.add_argument("--fetch-ahead", type=int, default=2)
    args = p.parse_args()
    if args.what == "one":
        print(json.dumps(one(args.mode, args.n, args.trace)))
        return 0
    if args.what in ("sampler", "all"):
        bench_sampler([int(x) for x in args.sizes.split(",")], args.repeats)
    if args.what in ("fetch", "all"):
        bench_fetch(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
