"""16-bit casts: halve the bytes of an all-reduce, no state.

``fp16`` divides by the world size before the cast (so the sum cannot overflow
65504); ``bf16`` has fp32's range and divides after. No error feedback: the
rounding error is unbiased and tiny next to SGD noise, as torch's own
bf16/fp16 hooks assume.

Example::

    Cast(torch.bfloat16).reduce(flat, wire, key=0)
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ...network.link import allreduce_bytes
from .base import Codec, Layout, Wire


class Cast(Codec):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"Cast supports float16 and bfloat16, got {dtype}")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def encode(self, flat: torch.Tensor, n: int) -> torch.Tensor:
        """The 16-bit payload. fp16 divides ``flat`` in place (``decode`` overwrites it
        anyway), as torch's fp16_compress_hook does: ``flat.div(n)`` made a whole fp32
        copy of the bucket first. Measured on the benchmark MLP (2 ranks, loopback, one
        core each, load ~3, medians of 20 steps, 3 runs, interleaved in one process):
        the in-place step 0.89-0.94x the copying one; 0.98-1.08x torch's hook."""
        if self.dtype == torch.float16:
            return flat.div_(n).to(self.dtype)
        return flat.to(self.dtype)

    def decode(self, payload: torch.Tensor, flat: torch.Tensor, n: int) -> torch.Tensor:
        flat.copy_(payload)
        return flat if self.dtype == torch.float16 else flat.div_(n)

    def reduce(self, flat: torch.Tensor, wire: Wire, key: Hashable, layout: Layout | None = None) -> torch.Tensor:
        payload = self.encode(flat, wire.size)
        wire.allreduce(payload)
        return self.decode(payload, flat, wire.size)

    def wire_bytes(self, numel: int, n: int, layout: Layout | None = None, itemsize: int = 4) -> float:
        return allreduce_bytes(numel * 2, n)  # 16 bits whatever the gradients' width
