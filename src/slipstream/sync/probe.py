"""Measure a link: latency (alpha) and bandwidth (beta) of all-reduce on a process group.

The alpha-beta model (:mod:`.link`) says one all-reduce of S bytes on n ranks
takes ``alpha + 2(n-1)/n * S / bytes_per_s``. Two sizes (a small one that shows the
latency, a large one that shows the bandwidth), a few timed repetitions each,
medians, and the slowest rank's figure (all-reduce MAX) so that every rank
fits the same line and takes the same decisions from it.

Example::

    link = probe_link(group)            # collective: every rank of group calls it
    link.seconds(4 << 20)               # predicted time of an all-reduce sending 4 MiB per rank
    link.summary()                      # "2 ranks, latency 0.20 ms, 0.936 Gbit/s"
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from ..link import Link, allreduce_bytes


def probe_link(
    group: Any = None,
    sizes_bytes: tuple[int, int] = (8 << 10, 4 << 20),
    repeats: int = 3,
    device: torch.device | str = "cpu",
    control: Any = None,
) -> Link:
    """Time all-reduce at two sizes on ``group`` and fit the alpha-beta line: a measured :class:`Link`.

    The timed all-reduces are data collectives: tensors on ``device`` (the
    training device: CUDA under NCCL), timed with CUDA events there, since an
    NCCL call returns at enqueue. The figures are agreed (slowest rank) on
    ``control``, a :class:`~slipstream.sync.control.ControlWire` (default: one
    over ``group``, which must then be a gloo group).
    """
    from ..timing import clock_for, duration_s
    from .control import ControlWire

    device = torch.device(device)
    n = dist.get_world_size(group)
    if n <= 1:
        return Link.measured(n, 0.0, float("inf"))
    clock = clock_for(device)
    medians = []
    for size in sizes_bytes:
        t = torch.zeros(max(1, size // 4), device=device)
        dist.all_reduce(t, group=group)  # warm-up (connections, buffers)
        marks = [clock.mark()]
        for _ in range(repeats):
            dist.all_reduce(t, group=group)
            marks.append(clock.mark())
        clock.synchronize(marks[-1:])  # once per size, at set-up: not a training step
        medians.append(statistics.median(duration_s(a, b) for a, b in zip(marks, marks[1:])))
    wire = control if control is not None else ControlWire(group)
    t1, t2 = wire.agree(medians, op=dist.ReduceOp.MAX)
    b1, b2 = (allreduce_bytes(s, n) for s in sizes_bytes)
    bw = (b2 - b1) / max(t2 - t1, 1e-9)
    alpha = max(0.0, t1 - b1 / bw)
    return Link.measured(n, alpha, bw, zip(sizes_bytes, (t1, t2)))
