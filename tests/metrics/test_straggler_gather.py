"""Where the straggler exchange's tensors live, per backend, taken on the CPU (issue #42).

The per-log-step gather of phase times runs on the default group: on NCCL its
tensors must be on the rank's GPU (NCCL refuses host tensors), on gloo on the
host even when the training device is a GPU (gloo's all_gather of device
tensors is what crashed the first GPU run's FSDP steps). The CPU suite only
ever ran gloo on the CPU; here the collective is a stand-in, and the meta
device stands for the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from slipstream.metrics.straggler import start_gather

GPU = torch.device("meta")  # stands for cuda:N: any device that is not the host


class _Work:
    def __init__(self, out, values):
        self.out, self.values, self.waited = out, values, False

    def wait(self):
        for rank, t in enumerate(self.out):  # rank r reports its times plus r
            t.copy_(torch.tensor([v + rank for v in self.values], dtype=t.dtype))
        self.waited = True


@pytest.fixture
def group(monkeypatch):
    seen: dict = {}

    def install(backend: str) -> dict:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

        def all_gather(out, tensor, group=None, async_op=False):
            seen.update(out=out, tensor=tensor, async_op=async_op)
            seen["work"] = _Work(out, tensor.tolist() if tensor.device.type == "cpu" else [])
            return seen["work"]

        monkeypatch.setattr(dist, "all_gather", all_gather)
        return seen

    return install


def test_nccl_gathers_on_the_ranks_gpu_without_waiting(group):
    seen = group("nccl")
    start_gather([0.1, 0.2], GPU)
    assert seen["tensor"].device == GPU and all(t.device == GPU for t in seen["out"])
    assert seen["async_op"] is True and not seen["work"].waited  # waited for at the next log step
    assert seen["tensor"].dtype == torch.float64


@pytest.mark.parametrize("device", [GPU, torch.device("cpu")], ids=["gloo-with-gpu-training", "gloo-on-cpu"])
def test_gloo_gathers_host_tensors_whatever_the_training_device(group, device):
    seen = group("gloo")
    pending = start_gather([0.5, 1.5], device)
    assert seen["tensor"].device.type == "cpu" and all(t.device.type == "cpu" for t in seen["out"])
    assert pending.result() == [[0.5, 1.5], [1.5, 2.5]]
