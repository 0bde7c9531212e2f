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
    device: torch.device | str = "cpu",
    control: Any = None,
) -> LinkFigures:
    """Time all-reduce at two sizes on ``group`` and fit the alpha-beta line.

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
        return LinkFigures(n, 0.0, float("inf"))
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
    b1, b2 = (2 * (n - 1) / n * s for s in sizes_bytes)
    bw = (b2 - b1) / max(t2 - t1, 1e-9)
    alpha = max(0.0, t1 - b1 / bw)
    return LinkFigures(n, alpha, bw, [(s, t) for s, t in zip(sizes_bytes, (t1, t2))])
