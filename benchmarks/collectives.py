"""Collective bandwidth, nccl-tests style: all-reduce, reduce-scatter, all-gather.

One worker per rank (started by ``benchmarks.run`` in an emulated cluster)::

    slipstream run --emulate 2x2 --link 1gbit -m benchmarks.collectives --max-bytes 64M --out c.json

For each operation and message size S (bytes of the full, per-rank-input
tensor for all-reduce; of the full output for all-gather and of the full input
for reduce-scatter, as nccl-tests does), rank 0 records the median time t of
``--iters`` timed calls after ``--warmup`` untimed ones, and:

* algbw = S / t
* busbw = algbw * 2(n-1)/n for all-reduce, algbw * (n-1)/n for reduce-scatter
  and all-gather: the rate each link must carry, comparable to the link rate.

"flat" runs the collective over all ranks; "hierarchical" (more than one
process per node) does all-reduce as intra-node reduce-scatter, inter-node
all-reduce among ranks of equal local rank, intra-node all-gather, the way
Slipstream's hierarchical strategy does. The node's interface ``tx_bytes`` per
call is recorded beside each figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from slipstream.network.link import allreduce_bytes, reduce_scatter_bytes

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def parse_bytes(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower().rstrip("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def sizes(min_bytes: int, max_bytes: int) -> list[int]:
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= 4
    return out


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw: the wire bytes per rank of one collective over its payload (slipstream.network.link's ring formulas)."""
    return allreduce_bytes(1.0, n) if op == "all_reduce" else reduce_scatter_bytes(1.0, n)


class Groups:
    """Flat group, plus intra-node and inter-node groups when there are several ranks per node."""

    def __init__(self) -> None:
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.nodes = self.world // self.local
        self.intra = self.inter = None
        if self.local > 1 and self.nodes > 1:
            for node in range(self.nodes):  # every rank must create every group, in the same order
                g = dist.new_group(list(range(node * self.local, (node + 1) * self.local)))
                if self.rank // self.local == node:
                    self.intra = g
            for lr in range(self.local):
                g = dist.new_group([node * self.local + lr for node in range(self.nodes)])
                if self.rank % self.local == lr:
                    self.inter = g


def run_op(op: str, numel: int, n: int, groups: Groups, mode: str):
    """A callable doing one collective of the given size, buffers allocated once."""
    if op == "all_reduce":
        buf = torch.ones(numel)
        if mode == "flat":
            return lambda: dist.all_reduce(buf)
        shard = torch.empty(numel // groups.local)

        def hier() -> None:
            dist.reduce_scatter_tensor(shard, buf, group=groups.intra)
            dist.all_reduce(shard, group=groups.inter)
            dist.all_gather_into_tensor(buf, shard, group=groups.intra)

        return hier
    if op == "reduce_scatter":
        inp, out = torch.ones(numel), torch.empty(numel // n)
        return lambda: dist.reduce_scatter_tensor(out, inp)
    inp, out = torch.ones(numel // n), torch.empty(numel)
    return lambda: dist.all_gather_into_tensor(out, inp)


def _tx() -> int | None:
    ifname = os.environ.get("SLIPSTREAM_EMULATED_IFNAME")
    if not ifname:
        return None
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as fh:
        return int(fh.read())


def main() -> None:
    p = argparse.ArgumentParser(description="collective bandwidth worker (one rank)")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--min-bytes", default="1K")
    p.add_argument("--max-bytes", default="256M")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=20.0, help="per size: fewer iterations when one call is slow")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    torch.set_num_threads(1)
    # all_gather_into_tensor / reduce_scatter_tensor warn about renames in torch 2.13; they are what
    # every torch since 2.0 has, so keep them and keep the logs readable.
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo")
    groups = Groups()
    n, rank = groups.world, groups.rank
    rows = []
    modes = ["flat"] + (["hierarchical"] if groups.intra is not None else [])
    for op in args.ops.split(","):
        for mode in modes if op == "all_reduce" else ["flat"]:
            for size in sizes(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)):
                numel = max(n * groups.local, size // 4 // (n * groups.local) * (n * groups.local))
                call = run_op(op, numel, n, groups, mode)
                times = []
                t_first = time.perf_counter()
                for _ in range(args.warmup):
                    call()
                dist.barrier()
                warm_s = (time.perf_counter() - t_first) / max(1, args.warmup)
                iters = max(1, min(args.iters, int(args.budget_s / max(warm_s, 1e-6))))
                tx0 = _tx()
                for _ in range(iters):
                    # Agree on the start, so t is the collective alone, not a late rank.
                    dist.barrier()
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                tx1 = _tx()
                # The slowest rank sets the time of each call.
                t = torch.tensor(times)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                t_med = statistics.median(t.tolist())
                nbytes = numel * 4
                algbw = nbytes / t_med
                rows.append({
                    "op": op, "mode": mode, "bytes": nbytes, "iters": iters, "time_s": t_med,
                    "algbw_Bps": algbw, "busbw_Bps": algbw * bus_factor(op, n),
                    # tx counters include the barriers' few hundred bytes per call.
                    "node_tx_bytes_per_call": None if tx0 is None else (tx1 - tx0) / iters,
                })
    if rank == 0:
        doc = {
            "kind": "collectives", "world_size": n, "nodes": groups.nodes, "procs_per_node": groups.local,
            "rows": rows, "torch": torch.__version__,
        }
        with open(args.out + ".tmp", "w") as fh:
            json.dump(doc, fh)
        os.replace(args.out + ".tmp", args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
