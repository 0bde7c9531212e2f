"""CUDA memory figures for the metrics record, read and never reset.

The caching allocator's counters (``torch.cuda.max_memory_allocated`` and the
rest) are process-wide: the user's own code reads the same ones. The recorder
used to reset the peak counters at each log step to get a per-window peak; on an H200 (2026-12-04) a user's ``max_memory_allocated()``
after training then read 2.6 GiB under Slipstream against 13.6 GiB for the
same loop without it. A wrapper must not change state its user reads, so this
module only reads.

What the record holds, then: ``cuda_peak_allocated_bytes`` and
``cuda_peak_reserved_bytes`` are the process's peaks so far (monotonic, unless
the user resets the counters themselves: they are the user's counters). A
per-window peak cannot be derived without a reset (the allocator keeps one
high-water mark, not a history), and a figure that silently changed meaning
when the user reset the counters would be worse than the plain peak so far:
the peak is the figure that decides whether a run fits, and it is what the
report's "peak memory" shows.

Every access to ``torch.cuda``'s memory statistics in the engine goes through
:class:`CudaMemory`, whose namespace a test can replace with a fake that
records calls (``tests/metrics/test_cuda_memory.py``).

Example::

    mem = CudaMemory(torch.device("cuda", 0))
    mem.fields()    # {"cuda_peak_allocated_bytes": 14602747904, "cuda_peak_reserved_bytes": ...}
"""

from __future__ import annotations

from typing import Any

import torch


class CudaMemory:
    """Reads the CUDA allocator's peak figures of ``device``; changes nothing.

    ``cuda`` is the namespace the figures come from: ``torch.cuda`` (the default,
    looked up at each read), or a stand-in with ``max_memory_allocated(device)`` and
    ``max_memory_reserved(device)`` in tests.
    """

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.device = device
        self._cuda = cuda

    def fields(self) -> dict[str, int]:
        """The record's memory fields: the process's peaks so far, in bytes."""
        cuda = self._cuda if self._cuda is not None else torch.cuda
        return {
            "cuda_peak_allocated_bytes": int(cuda.max_memory_allocated(self.device)),
            "cuda_peak_reserved_bytes": int(cuda.max_memory_reserved(self.device)),
        }


__all__ = ["CudaMemory"]
