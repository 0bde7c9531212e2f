"""The comm thread's CUDA path, in its call order, on the CPU (issue #42).

``OrderedQueue(device=cuda)`` is what every compressing strategy runs its codecs
in on a GPU: the thread must make the rank's GPU current before its first CUDA
call (else each rank opens a context on GPU 0), make one side stream, run each
job and complete its future while that stream is current, and hand out
CUDA-aware futures (``devices=[device]``), so DDP waits on the device. None of
that runs on a CPU (no CUDA device: the queue takes the plain path). Here torch's
CUDA stream API and the CUDA-aware future are stand-ins that record the calls.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from slipstream.sync import ordering


class _Calls:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current: object | None = None  # the stream made current by torch.cuda.stream()

    def add(self, *entry) -> None:
        self.log.append((*entry, threading.current_thread().name))


@pytest.fixture
def cuda_api(monkeypatch):
    calls = _Calls()

    class Stream:
        def __init__(self, device=None):
            calls.add("Stream", device)

    @contextlib.contextmanager
    def stream(s):
        calls.add("enter", s)
        before, calls.current = calls.current, s
        try:
            yield
        finally:
            calls.current = before
            calls.add("exit", s)

    class Future(torch.futures.Future):
        """The CUDA-aware future a CPU build refuses to make; records its devices and when it completes."""

        def __init__(self, devices=None):
            super().__init__()
            self.devices = devices

        def set_result(self, result):
            if not getattr(self, "_failing", False):  # torch's set_exception goes through set_result
                calls.add("set_result", calls.current)
            super().set_result(result)

        def set_exception(self, exc):
            calls.add("set_exception", calls.current)
            self._failing = True
            super().set_exception(exc)

    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.add("set_device", d))
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.futures, "Future", Future)
    return calls


def test_the_thread_sets_its_gpu_first_and_runs_every_job_on_one_side_stream(cuda_api):
    device = torch.device("cuda", 3)
    q = ordering.OrderedQueue(device=device)
    try:
        futures = [q.submit(lambda i=i: cuda_api.add("job", i, cuda_api.current) or i) for i in range(3)]
        futures.append(q.submit(lambda: 1 / 0))
        assert [f.wait() for f in futures[:3]] == [0, 1, 2]
        with pytest.raises(ZeroDivisionError):
            futures[3].wait()
    finally:
        q.close()
    assert all(f.devices == [device] for f in futures), "futures must be CUDA-aware on the rank's GPU"
    log = cuda_api.log
    assert {entry[-1] for entry in log} == {ordering.THREAD_NAME}, "CUDA calls made outside the comm thread"
    assert log[0][:2] == ("set_device", device), f"the thread's first CUDA call was {log[0]}"
    assert log[1][:2] == ("Stream", device)
    streams = {entry[1] for entry in log if entry[0] in ("enter", "exit")}
    assert len(streams) == 1, "one side stream for every job"
    side = streams.pop()
    jobs = [entry for entry in log if entry[0] == "job"]
    assert [j[1] for j in jobs] == [0, 1, 2] and all(j[2] is side for j in jobs)
    completions = [entry for entry in log if entry[0] in ("set_result", "set_exception")]
    assert [c[0] for c in completions] == ["set_result"] * 3 + ["set_exception"]
    assert all(c[1] is side for c in completions), "a future completed while the side stream was not current"
    assert sum(1 for e in log if e[0] == "set_device") == 1 and sum(1 for e in log if e[0] == "Stream") == 1


def test_a_cpu_queue_makes_no_cuda_call(cuda_api):
    q = ordering.OrderedQueue(device=torch.device("cpu"))
    try:
        fut = q.submit(lambda: 7)
        assert fut.wait() == 7
    finally:
        q.close()
    assert fut.devices is None
    assert [e for e in cuda_api.log if e[0] != "set_result"] == []
