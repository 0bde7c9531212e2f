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
from dataclasses import dataclass
from typing import Any

import torch

from ...network.link import all_gather_bytes
from .base import ErrorFeedback, Layout, Wire, all_finite

_SHIFTS = torch.arange(8, dtype=torch.uint8)
# Byte -> its 8 signs as +1/-1: one table lookup per byte instead of shifts, masks and casts.
_TABLE = ((torch.arange(256).view(-1, 1) >> torch.arange(8)) & 1).float().mul_(2).sub_(1)
# Copies of the two tables on each (device, dtype) used: a .to() per call is a
# host-to-device copy per bucket on CUDA.
_ON_DEVICE: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


def _constant(name: str, table: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    key = (name, device, dtype)
    t = _ON_DEVICE.get(key)
    if t is None:
        t = _ON_DEVICE[key] = table.to(device=device, dtype=dtype, copy=True)
    return t


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """1 where x >= 0, packed little-endian 8 per uint8; x.numel() must divide by 8."""
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    return (bits << _constant("shifts", _SHIFTS, x.device, torch.uint8)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: +1/-1 values, 8 per byte."""
    table = _constant("table", _TABLE, packed.device, dtype)
    return table.index_select(0, packed.view(-1).long()).view(-1)


@dataclass(frozen=True)
class _Plan:
    runs: list[tuple[int, int, int]]  # (offset in flat, offset in padded, length): one copy each
    chunks: int
    counts: torch.Tensor  # real values per chunk, on the device
    unpadded: bool  # padded buffer == flat: nothing to copy


class ScaledSign(ErrorFeedback):
    name = "sign"
    collectives_per_call = 2

    def __init__(self, chunk_numel: int = 1024):
        super().__init__()
        if chunk_numel < 8 or chunk_numel % 8:
            raise ValueError(f"chunk_numel must be a positive multiple of 8, got {chunk_numel}")
        self.chunk_numel = chunk_numel
        self._plans: dict[tuple[tuple[tuple[int, int], ...], torch.device], _Plan] = {}

    def _segments(self, numel: int, layout: Layout | None) -> list[tuple[int, int]]:
        """(offset, numel) of the runs chunked separately: one per parameter when the
        layout is known (chunks never mix parameters, and the result does not depend
        on how DDP orders parameters in a bucket), else the whole vector."""
        if layout is None or sum(p.numel for p in layout) != numel:
            return [(0, numel)]
        return [(p.offset, p.numel) for p in layout]

    def _chunks(self, numel: int) -> int:
        return -(-numel // self.chunk_numel)

    def _plan(self, segments: list[tuple[int, int]], device: torch.device) -> _Plan:
        """How ``segments`` map into the padded chunk buffer; cached per layout and device."""
        key = (tuple(segments), device)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        cn = self.chunk_numel
        runs: list[list[int]] = []  # [offset in flat, offset in padded, length]
        counts: list[float] = []
        pos = 0
        for off, n in segments:
            k = self._chunks(n)
            if runs and runs[-1][0] + runs[-1][2] == off and runs[-1][1] + runs[-1][2] == pos:
                runs[-1][2] += n  # no padding since the last run: one copy covers both
            else:
                runs.append([off, pos, n])
            counts += [float(cn)] * (k - 1) + [float(n - (k - 1) * cn)]  # the last chunk may be short
            pos += k * cn
        numel = sum(n for _, n in segments)
        plan = _Plan(
            runs=[(o, q, m) for o, q, m in runs],
            chunks=len(counts),
            counts=torch.tensor(counts, dtype=torch.float32).to(device),
            unpadded=pos == numel and len(runs) == 1,
        )
        self._plans[key] = plan
        return plan

    def reduce(self, flat: torch.Tensor, wire: Wire, key: Hashable, layout: Layout | None = None) -> torch.Tensor:
        c = self._compensate(key, flat, layout)
        plan = self._plan(self._segments(c.numel(), layout), c.device)
        cn, chunks = self.chunk_numel, plan.chunks
        if plan.unpadded:  # every parameter fills whole chunks: chunk c itself, no copy
            padded = c.view(-1)
        else:
            padded = torch.zeros(chunks * cn, dtype=c.dtype, device=c.device)
            for off, pos, n in plan.runs:
                padded[pos : pos + n] = c[off : off + n]
        view = padded.view(chunks, cn)
        # Mean |x| over the real values of each chunk: the L2-best scale for its signs.
        scales = view.abs().sum(dim=1).div_(plan.counts)
        packed = pack_signs(padded)
        s_col = scales.view(-1, 1)
        local = torch.where(view >= 0, s_col, -s_col).view(-1)  # what the others will decode
        all_packed = wire.allgather(packed)
        all_scales = wire.allgather(scales)
        # A chunk holding inf/NaN has a non-finite mean |x|: the same flag on every rank,
        # and the decoded output of that chunk is non-finite everywhere.
        finite = all_finite(all_scales)
        out = torch.zeros_like(view)
        for r in range(wire.size):
            out.addcmul_(unpack_signs(all_packed[r], c.dtype).view(chunks, cn), all_scales[r].view(-1, 1))
        out = out.view(-1).div_(wire.size)
        residual = torch.empty_like(c)
        for off, pos, n in plan.runs:
            torch.sub(c[off : off + n], local[pos : pos + n], out=residual[off : off + n])
            c[off : off + n] = out[pos : pos + n]
        self._store(key, residual, layout, finite)
        return c

    def wire_bytes(self, numel: int, n: int, layout: Layout | None = None, itemsize: int = 4) -> float:
        chunks = sum(self._chunks(m) for _, m in self._segments(numel, layout))
        return all_gather_bytes(chunks * self.chunk_numel / 8 + itemsize * chunks, n)  # scales in the gradients' dtype

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "chunk_numel": self.chunk_numel}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.chunk_numel = int(state.get("chunk_numel", self.chunk_numel))
        self._plans = {}
