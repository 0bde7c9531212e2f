"""Scaled sign (1 bit per value) with error feedback.

The error-compensated gradient is cut into chunks of ``chunk_numel`` values;
each chunk is sent as its signs, packed 8 to a byte, and one fp32 scale (the
chunk's mean absolute value, which makes scale*sign the best 1-bit
approximation in L2 for a fixed sign pattern). Signs and scales are
all-gathered (1-bit data cannot be summed on the wire) and every rank
averages the decoded vectors. What the 1-bit form left out is kept and added
to the next step's gradient (EF-SignSGD, Karimireddy et al. 2019).

Bytes per rank: (n-1) * (numel/8 + 4*numel/chunk_numel): about 1/31 of fp32 (n=2).

Example::

    ScaledSign(chunk_numel=1024).reduce(flat, wire, key=0)
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from .base import ErrorFeedback, Layout, Wire

_SHIFTS = torch.arange(8, dtype=torch.uint8)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """1 where x >= 0, packed little-endian 8 per uint8; x.numel() must divide by 8."""
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    return (bits << _SHIFTS.to(x.device)).sum(dim=1, dtype=torch.uint8)


# Byte -> its 8 signs as +1/-1: one table lookup per byte instead of shifts, masks and casts.
_TABLE = ((torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1).float().mul_(2).sub_(1)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: +1/-1 values, 8 per byte."""
    table = _TABLE.to(device=packed.device, dtype=dtype)
    return table.index_select(0, packed.view(-1).long()).view(-1)


class ScaledSign(ErrorFeedback):
    name = "sign"
    collectives_per_call = 2

    def __init__(self, chunk_numel: int = 1024):
        super().__init__()
        if chunk_numel < 8 or chunk_numel % 8:
            raise ValueError(f"chunk_numel must be a positive multiple of 8, got {chunk_numel}")
        self.chunk_numel = chunk_numel

    def _segments(self, numel: int, layout: Layout | None) -> list[tuple[int, int]]:
        """(offset, numel) of the runs chunked separately: one per parameter when the
        layout is known (chunks never mix parameters, and the result does not depend
        on how DDP orders parameters in a bucket), else the whole vector."""
        if layout is None or sum(p.numel for p in layout) != numel:
            return [(0, numel)]
        return [(p.offset, p.numel) for p in layout]

    def _chunks(self, numel: int) -> int:
        return -(-numel // self.chunk_numel)

    def reduce(self, flat: torch.Tensor, wire: Wire, key: Hashable, layout: Layout | None = None) -> torch.Tensor:
        c = self._compensate(key, flat, layout)
        segments = self._segments(c.numel(), layout)
        cn = self.chunk_numel
        chunks = sum(self._chunks(n) for _, n in segments)
        padded = torch.zeros(chunks * cn, dtype=c.dtype, device=c.device)
        counts = torch.full((chunks,), float(cn), device=c.device)
        pos = chunk = 0
        for off, n in segments:
            padded[pos : pos + n] = c[off : off + n]
            k = self._chunks(n)
            counts[chunk + k - 1] = n - (k - 1) * cn  # the last chunk of a segment may be short
            pos, chunk = pos + k * cn, chunk + k
        view = padded.view(chunks, cn)
        # Mean |x| over the real values of each chunk: the L2-best scale for its signs.
        scales = view.abs().sum(dim=1).div_(counts)
        packed = pack_signs(padded)
        s_col = scales.view(-1, 1)
        local = torch.where(view >= 0, s_col, -s_col).view(-1)  # what the others will decode
        all_packed = wire.allgather(packed)
        all_scales = wire.allgather(scales)
        out = torch.zeros_like(view)
        for r in range(wire.size):
            out.addcmul_(unpack_signs(all_packed[r], c.dtype).view(chunks, cn), all_scales[r].view(-1, 1))
        out = out.view(-1).div_(wire.size)
        residual = torch.empty_like(c)
        pos = 0
        for off, n in segments:
            residual[off : off + n] = c[off : off + n] - local[pos : pos + n]
            c[off : off + n] = out[pos : pos + n]
            pos += self._chunks(n) * cn
        self._store(key, residual, layout)
        return c

    def wire_bytes(self, numel: int, n: int, layout: Layout | None = None) -> float:
        chunks = sum(self._chunks(m) for _, m in self._segments(numel, layout))
        return (n - 1) * (chunks * self.chunk_numel / 8 + 4 * chunks)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "chunk_numel": self.chunk_numel}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.chunk_numel = int(state.get("chunk_numel", self.chunk_numel))
