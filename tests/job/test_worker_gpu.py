"""The worker shim's GPU memory cap on a machine with GPUs, taken on the CPU (issue #42).

``apply_memory_fraction`` does nothing without CUDA, which is all the CPU suite
ever saw; here torch.cuda is a stand-in for a machine with GPUs and the cap
must go to the worker's own device, the one ``slipstream.init`` will pick.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.job import worker


@pytest.fixture
def gpus(monkeypatch):
    caps: list[tuple[float, int]] = []

    def install(count: int) -> list[tuple[float, int]]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                            lambda fraction, device=None: caps.append((fraction, device)))
        return caps

    return install


@pytest.mark.parametrize(("count", "local_rank", "device"), [(4, "2", 2), (2, "3", 1), (1, "5", 0)],
                         ids=["own-gpu", "ranks-share-gpus", "one-visible-gpu"])
def test_the_cap_goes_to_the_workers_device(gpus, count, local_rank, device):
    """cuda:local_rank with a GPU each; shared round-robin (gloo on fewer GPUs); the one GPU a
    per-task binding leaves visible."""
    caps = gpus(count)
    assert worker.apply_memory_fraction({worker.ENV_FRACTION: "0.25", "LOCAL_RANK": local_rank}) == 0.25
    assert caps == [(0.25, device)]


def test_no_cap_without_a_gpu_and_a_bad_value_is_refused_before_torch_is_asked(gpus):
    caps = gpus(0)
    assert worker.apply_memory_fraction({worker.ENV_FRACTION: "0.5", "LOCAL_RANK": "0"}) is None
    assert worker.apply_memory_fraction({}) is None
    gpus(2)
    with pytest.raises(SystemExit, match=r"must be a number in \(0, 1\], got 'half'"):
        worker.apply_memory_fraction({worker.ENV_FRACTION: "half"})
    with pytest.raises(SystemExit, match=r"must be in \(0, 1\], got '0'"):
        worker.apply_memory_fraction({worker.ENV_FRACTION: "0"})
    assert caps == []
