"""Measure a link: latency (alpha) and bandwidth (beta) of all-reduce on a process group.

The alpha-beta model says one all-reduce of S bytes on n ranks takes
``alpha + 2(n-1)/n * S / bytes_per_s``. Two sizes (a small one that shows the
latency, a large one that shows the bandwidth), a few timed repetitions each,
medians, and the slowest rank's figure (all-reduce MAX) so that every rank
fits the same line and takes the same decisions from it.

Example::

    link = probe_link(group)            # collective: every rank of group calls it
    link.seconds(4 << 20)               # predicted time of a 4 MiB all-reduce
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class LinkFigures:
    ranks: int
    alpha_s: float
    bytes_per_s: float
    samples: list[tuple[int, float]] = field(default_factory=list)  # (payload bytes, median seconds)

    def seconds(self, payload_bytes: float, collectives: int = 1) -> float:
        """Time for ``collectives`` all-reduces moving ``payload_bytes`` per rank in all."""
        if self.ranks <= 1:
            return 0.0
        return collectives * self.alpha_s + payload_bytes / self.bytes_per_s

    def summary(self) -> str:
        if self.ranks <= 1:
            return "single rank"
        return f"{self.ranks} ranks, latency {self.alpha_s * 1e3:.2f} ms, {self.bytes_per_s * 8 / 1e9:.3f} Gbit/s"


def probe_link(
    group: Any = None,
    sizes_bytes: tuple[int, int] = (8 << 10, 4 << 20),
    repeats: int = 3,
) -> LinkFigures:
    """Time all-reduce at two sizes on ``group`` and fit the alpha-beta line."""
    n = dist.get_world_size(group)
    if n <= 1:
        return LinkFigures(n, 0.0, float("inf"))
    medians = []
    for size in sizes_bytes:
        t = torch.zeros(max(1, size // 4))
        dist.all_reduce(t, group=group)  # warm-up (connections, buffers)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    agreed = torch.tensor(medians, dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    (t1, t2) = agreed.tolist()
    b1, b2 = (2 * (n - 1) / n * s for s in sizes_bytes)
    bw = (b2 - b1) / max(t2 - t1, 1e-9)
    alpha = max(0.0, t1 - b1 / bw)
    return LinkFigures(n, alpha, bw, [(s, t) for s, t in zip(sizes_bytes, (t1, t2))])
