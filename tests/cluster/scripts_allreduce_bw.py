"""Worker for the link tests: time gloo all-reduces between emulated nodes, without the launcher.

    python scripts_allreduce_bw.py MASTER_ADDR PORT RANK WORLD MIB REPEATS OUT.json

Rank 0 writes OUT.json: the median seconds of one all-reduce of MIB MiB, its bus
bandwidth (bytes/s; busbw = S / t * 2(n-1)/n), whether the sum came out right,
and the link that ``auto``'s probe (slipstream.sync.probe.probe_link) measures.
"""

import datetime
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from slipstream.sync.probe import probe_link

addr, port, rank, world, mib, repeats, out = sys.argv[1:8]
rank, world, repeats = int(rank), int(world), int(repeats)
torch.set_num_threads(1)
store = dist.TCPStore(addr, int(port), world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
size = int(float(mib) * 2**20)
t = torch.ones(size // 4)
dist.all_reduce(t)  # warm-up: connections, TCP windows
times = []
for _ in range(repeats):
    t.fill_(rank + 1)
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(t)
    times.append(time.perf_counter() - start)
ok = bool((t == world * (world + 1) / 2).all())
median = statistics.median(times)
link = probe_link()
if rank == 0:
    with open(out, "w") as fh:
        json.dump({"median_s": median, "times_s": times, "busbw_bytes_per_s": size / median * 2 * (world - 1) / world,
                   "sum_ok": ok, "probe_alpha_s": link.alpha_s, "probe_hop_latency_s": link.hop_latency_s,
                   "probe_bytes_per_s": link.bytes_per_s}, fh)
dist.destroy_process_group()
