"""Top-k sparsification with error feedback.

Each rank keeps the ``density`` fraction of its (error-compensated) gradient
with the largest magnitudes, sends their values and int32 indices with one
all-gather each, and adds what it left out to next step's gradient. Ranks pick
different coordinates, so an all-reduce cannot combine them; an all-gather of
(values, indices) and a local scatter-add can.

Bytes per rank: (n-1) * k * 8 for k = density * numel, against 2(n-1)/n * 4 * numel
for fp32 all-reduce: density 0.01 sends 1/25 (n=2).

Example::

    TopK(density=0.01).reduce(flat, wire, key=3)
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import torch

from ...network.link import all_gather_bytes
from .base import ErrorFeedback, Layout, Wire, all_finite

# Device types where select() may take the sampled threshold: there the count check reads
# a value on the host, which stalls nothing. Elsewhere (CUDA) torch.topk is fast, and
# that read would be a host sync per bucket.
SAMPLED_SELECT_DEVICES = frozenset({"cpu"})
SAMPLED_SELECT_MIN_NUMEL = 1 << 16  # below this torch.topk is fast on the CPU too


def sampled_select(device: torch.device, numel: int, k: int) -> bool:
    """Whether :meth:`TopK.select` takes the sampled threshold for ``k`` of ``numel`` values on
    ``device`` (large buckets on the CPU, at most a quarter kept), rather than torch.topk.

    Example::

        sampled_select(torch.device("cpu"), 1 << 20, 10_000)       # True
        sampled_select(torch.device("cuda", 0), 1 << 20, 10_000)   # False: torch.topk
    """
    return device.type in SAMPLED_SELECT_DEVICES and numel >= SAMPLED_SELECT_MIN_NUMEL and k * 4 <= numel


class TopK(ErrorFeedback):
    name = "topk"
    collectives_per_call = 2

    def __init__(self, density: float = 0.01):
        super().__init__()
        if not 0.0 < density <= 1.0:
            raise ValueError(f"density must be in (0, 1], got {density}")
        self.density = density

    def k_of(self, numel: int) -> int:
        return max(1, min(numel, int(round(self.density * numel))))

    def select(self, c: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the k largest |c|: exactly torch.topk's set (up to ties), faster on CPU.

        A strided sample gives a threshold that about 2k values pass; if at least k
        pass, the top k are all among them and topk runs on that short list only.
        (Full torch.topk with k in the tens of thousands is slow on CPU.) On other
        devices torch.topk is fast, and the sampled path's count check would be a
        host sync, so they always take torch.topk (:func:`sampled_select`).

        Both paths pick k distinct indices with the same magnitudes; where several
        values tie with the k-th largest, which of them is picked may differ (as it
        does between torch.topk on the CPU and on an H200 for bf16 buckets).

        NaN ranks with inf, above every finite value: a NaN or inf in ``c`` is always
        selected, so an overflow reaches every rank through the gathered values.
        """
        a = c.abs()
        n = a.numel()
        if not sampled_select(a.device, n, k):
            return torch.topk(_nan_first(a), k, sorted=False).indices
        sample = a[:: max(1, n // (1 << 15))]
        rank = max(1, min(sample.numel(), int(sample.numel() * (1 - 2.0 * k / n))))
        threshold = sample.kthvalue(rank).values
        # not (a < t) rather than a >= t: NaN must pass (NaN >= t is false).
        candidates = a.lt(threshold).logical_not_().nonzero().view(-1)
        if candidates.numel() < k:
            return torch.topk(_nan_first(a), k, sorted=False).indices
        return candidates[torch.topk(_nan_first(a[candidates]), k, sorted=False).indices]

    def reduce(self, flat: torch.Tensor, wire: Wire, key: Hashable, layout: Layout | None = None) -> torch.Tensor:
        c = self._compensate(key, flat, layout)
        k = self.k_of(c.numel())
        idx = self.select(c, k)
        vals = c[idx]
        all_vals = wire.allgather(vals)
        all_idx = wire.allgather(idx.to(torch.int32)).long()
        # Every rank's k values include its inf/NaN if it has one (select), so this is
        # the same on all ranks and false on an overflow step anywhere.
        finite = all_finite(all_vals)
        residual = c.clone()
        residual[idx] = 0.0
        self._store(key, residual, layout, finite)
        # One index_add_ per rank, in rank order: a rank's k indices are distinct, so no
        # call adds twice to one place. One call over all ranks' indices would (ranks
        # pick overlapping coordinates), and CUDA sums duplicates with atomics in an
        # order that differs run to run and rank to rank: the replicas would drift.
        c.zero_()
        for r in range(wire.size):
            c.index_add_(0, all_idx[r], all_vals[r])
        return c.div_(wire.size)

    def wire_bytes(self, numel: int, n: int, layout: Layout | None = None, itemsize: int = 4) -> float:
        return all_gather_bytes(self.k_of(numel) * (itemsize + 4), n)  # values in the gradients' dtype, int32 indices

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "density": self.density}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.density = float(state.get("density", self.density))


def _nan_first(a: torch.Tensor) -> torch.Tensor:
    """|values| with NaN turned into inf, in place: topk then ranks NaN with the largest."""
    return a.nan_to_num_(nan=math.inf, posinf=math.inf)
