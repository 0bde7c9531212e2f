"""One global collective order: a thread that runs the engine's jobs first-in, first-out.

Collectives launched from ``fut.then()`` callbacks run in completion order,
which differs between ranks; gloo then fails ("Received data size doesn't
match expected size", as torch's powerSGD_hook does with several buckets).
Work that launches more than one collective per bucket (PowerSGD, top-k,
sign, hierarchical reduction) and the engine's own control collectives go
through one :class:`OrderedQueue` per model instead, so they reach every rank
in submission order, which is DDP's bucket order, the same on every rank.

Example::

    q = OrderedQueue()
    fut = q.submit(lambda: codec.reduce(flat, wire, key))   # a torch.futures.Future
    q.close()
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

THREAD_NAME = "slipstream-sync"


class OrderedQueue:
    """One daemon thread running submitted jobs first-in, first-out.

    ``submit(fn)`` returns a ``torch.futures.Future`` completed with ``fn()``'s
    result (or its exception). Jobs run one at a time, so collectives they
    launch keep submission order.

    ``device`` CUDA: the thread makes it its current device before anything
    else (otherwise its first CUDA call creates a context on GPU 0, on every
    rank), runs every job on one side stream, and completes each future while
    that stream is current. The futures are CUDA-aware (``devices=[device]``):
    completing one records an event on the side stream, and whoever waits on
    it (DDP) has its current stream wait for that event on the device, not on
    the host.
    """

    def __init__(self, name: str = THREAD_NAME, device: torch.device | None = None):
        self.device = device if device is not None and device.type == "cuda" else None
        self.jobs_submitted = 0
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> torch.futures.Future:
        fut: torch.futures.Future = (
            torch.futures.Future(devices=[self.device]) if self.device is not None else torch.futures.Future()
        )
        self.jobs_submitted += 1
        self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        stream = None
        if self.device is not None:
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(device=self.device)
        while True:
            fn, fut = self._q.get()
            if fn is None:
                return
            if stream is None:
                self._complete(fn, fut)
                continue
            with torch.cuda.stream(stream):
                self._complete(fn, fut)

    @staticmethod
    def _complete(fn: Callable[[], Any], fut: torch.futures.Future) -> None:
        try:
            result = fn()
        except BaseException as exc:  # delivered to DDP's wait(), which raises it
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def close(self) -> None:
        self._q.put((None, None))
        # Joined so no collective of this thread is alive when the process
        # group is destroyed (a C++ worker torn down mid-use aborts the process).
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


__all__ = ["THREAD_NAME", "OrderedQueue"]
