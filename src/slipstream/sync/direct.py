"""The hook engine's direct path: one async all-reduce per bucket, decoded in ``fut.then()``.

Taken when every bucket needs one stateless collective and the engine none of its own (the
``bf16``/``fp16`` casts, fp32 all-reduce in warm-up or after a fallback, an ``auto`` plan of casts
and all-reduce once verified): the hook thread launches the collective itself, as torch's own
hooks do, with no ordering thread in between (:class:`~.hooks.HookSync` decides which path).

Example::

    direct = DirectPath()
    fut = direct.reduce(reducer.wire, bucket.buffer(), Cast(torch.bfloat16), step, last, clock, ledger_finish)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..network.link import allreduce_bytes
from ..process.timing import Mark
from .accounting import StepRecord
from .compress.base import Codec, Wire
from .compress.cast import Cast


class DirectPath:
    """Sends buckets straight from DDP's hook. The decode callbacks run on other threads (the
    collective's completion), so a step's counters are updated under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def reduce(self, wire: Wire, buf: torch.Tensor, codec: Codec, step: StepRecord, last: bool, clock: Any,
               finish: Callable[[StepRecord, Mark], None]) -> torch.futures.Future:
        """Average ``buf`` over ``wire`` through ``codec`` (all-reduce or a cast); counts the bytes
        on ``wire`` and ``step``, and calls ``finish(step, done)`` once the step's last collective
        (``last``: this is the step's last bucket) completed."""
        n = wire.size
        payload = codec.encode(buf, n) if isinstance(codec, Cast) else buf
        t0 = clock.mark()
        nbytes = allreduce_bytes(payload.numel() * payload.element_size(), n)
        with self._lock:
            wire.bytes_sent += nbytes
            step.bytes_sent += nbytes
            step.pending += 1
            step.last_seen = step.last_seen or last
        fut = dist.all_reduce(payload, group=wire.group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()[0]
            result = codec.decode(out, buf, n) if isinstance(codec, Cast) else out.div_(n)
            # On GPUs this callback runs at enqueue, on a stream that waits for the
            # collective: the mark's event completes when the collective has.
            t1 = clock.mark()
            with self._lock:
                step.comm_spans.append((t0, t1))
                step.pending -= 1
                if step.pending == 0 and step.last_seen:  # the last of the step's collectives
                    finish(step, t1)
            return result

        return fut.then(done)


__all__ = ["DirectPath"]
