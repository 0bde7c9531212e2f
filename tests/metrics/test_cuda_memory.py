"""The metrics read the CUDA allocator's peaks and never reset them (issue #42, part A).

The counters are process-wide: a user's ``torch.cuda.max_memory_allocated()`` after
training read 2.6 GiB under Slipstream against 13.6 GiB without it on an H200, because
the recorder reset them at each log step. There is no CUDA here, so the tests put a
recording stand-in where ``torch.cuda``'s memory functions are and run several log
steps through the recorder: the peak must be in every record, and no reset (nor any
other call that changes the allocator's state) may happen.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.config import TrainConfig
from slipstream.metrics import StepRecorder
from slipstream.metrics.memory import CudaMemory

# Every torch.cuda function that changes the allocator's counters or its cache.
CHANGERS = (
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    "reset_accumulated_memory_stats",
    "empty_cache",
)
GIB = 1 << 30


class RecordingCuda:
    """A stand-in for the ``torch.cuda`` namespace: the peak readers answer from a
    growing allocation, every call is recorded by name."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.allocated_peak = 0

    def max_memory_allocated(self, device=None) -> int:
        self.calls.append("max_memory_allocated")
        return self.allocated_peak

    def max_memory_reserved(self, device=None) -> int:
        self.calls.append("max_memory_reserved")
        return self.allocated_peak + GIB

    def changer(self, name: str):
        def call(*args, **kwargs) -> None:
            self.calls.append(name)

        return call


def test_the_seam_only_reads_the_peaks():
    # A namespace with nothing but the two readers: a reset through the seam would be an AttributeError.
    fake = RecordingCuda()
    fake.allocated_peak = 13 * GIB
    mem = CudaMemory(torch.device("cuda", 0), cuda=fake)
    assert mem.fields() == {"cuda_peak_allocated_bytes": 13 * GIB, "cuda_peak_reserved_bytes": 14 * GIB}
    assert fake.calls == ["max_memory_allocated", "max_memory_reserved"]


@pytest.fixture
def recording_cuda(monkeypatch):
    """torch.cuda's memory functions replaced by one recording stand-in (no CUDA here)."""
    fake = RecordingCuda()
    for name in ("max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    for name in CHANGERS:
        monkeypatch.setattr(torch.cuda, name, fake.changer(name))
        monkeypatch.setattr(torch.cuda.memory, name, fake.changer(name), raising=False)
    return fake


def test_a_run_of_several_log_steps_reports_the_peak_and_never_resets_it(recording_cuda):
    rec = StepRecorder(rank=0, world_size=1, run_dir=None, log_every_steps=2, progress=False, profile=False)
    # peak_flops given: the recorder then asks torch.cuda nothing about the device name.
    rec.attach(nn.Linear(4, 4), TrainConfig(profile=False, progress=False, peak_flops=1e12),
               device=torch.device("cuda", 0))
    peaks = []
    for step in range(1, 11):
        recording_cuda.allocated_peak = step * GIB  # the allocator's high-water mark grows
        rec.add_loss(torch.tensor(1.0))
        record = rec.end_step()
        if record is not None:
            peaks.append(record["cuda_peak_allocated_bytes"])
            assert record["cuda_peak_reserved_bytes"] == record["cuda_peak_allocated_bytes"] + GIB
    rec.close()
    assert peaks == [2 * GIB, 4 * GIB, 6 * GIB, 8 * GIB, 10 * GIB]  # the process's peak so far, every log step
    changed = [c for c in recording_cuda.calls if c in CHANGERS]
    assert changed == [], f"the recorder changed the user's CUDA memory state: {changed}"
    assert recording_cuda.calls.count("max_memory_allocated") == 5  # read on log steps only
