"""MFU is measured against the peak of the math actually in use: fp32 with TF32 off is
judged against the fp32 CUDA-core rate, not the TF32 tensor-core rate (7x higher on an H100)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.metrics import StepRecorder
from slipstream.metrics.profiler import default_peak_flops

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA device named like an H100 (the name is all the peak table reads), and the
    TF32 switch restored afterwards."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    for name in ("max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: 0)
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.fp32_precision)
    yield torch.device("cuda", 0)
    torch.backends.fp32_precision = saved[1]
    torch.backends.cuda.matmul.fp32_precision = saved[0]


def test_fp32_with_tf32_off_uses_the_fp32_peak(fake_gpu):
    assert torch.backends.cuda.matmul.fp32_precision in ("none", "ieee")  # torch's default: TF32 off
    assert default_peak_flops(fake_gpu, "fp32") == pytest.approx(67e12)


@pytest.mark.parametrize("switch", ["legacy", "matmul_precision", "new_api"])
def test_fp32_with_tf32_allowed_uses_the_tf32_peak(fake_gpu, switch):
    if switch == "legacy":
        torch.backends.cuda.matmul.allow_tf32 = True
    elif switch == "matmul_precision":
        torch.set_float32_matmul_precision("high")
    else:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert default_peak_flops(fake_gpu, "fp32") == pytest.approx(494.7e12)


def test_16_bit_precisions_use_their_dense_tensor_core_peaks(fake_gpu, monkeypatch):
    assert default_peak_flops(fake_gpu, "bf16") == pytest.approx(989.4e12)
    assert default_peak_flops(fake_gpu, "fp16") == pytest.approx(989.4e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-32GB")
    assert default_peak_flops(fake_gpu, "fp32") == pytest.approx(15.7e12)
    assert default_peak_flops(fake_gpu, "fp16") == pytest.approx(125e12)
    assert default_peak_flops(fake_gpu, "bf16") is None  # no bf16 tensor cores: no honest peak
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert default_peak_flops(fake_gpu, "fp32") == pytest.approx(51e12)


def test_the_recorder_reports_mfu_against_the_precision_in_effect_each_window(fake_gpu):
    from slipstream.config import TrainConfig

    rec = StepRecorder(rank=0, world_size=1, run_dir=None, log_every_steps=1, progress=False, profile=False)
    rec.attach(nn.Linear(4, 4), TrainConfig(profile=False, progress=False), device=fake_gpu)
    rec.add_tokens(1000)
    first = rec.end_step()
    assert first["mfu"] == pytest.approx(first["model_flops_per_s"] / 67e12)
    # TF32 turned on after accelerate(): the next window is judged against the TF32 peak.
    torch.set_float32_matmul_precision("high")
    rec.add_tokens(1000)
    second = rec.end_step()
    assert second["mfu"] == pytest.approx(second["model_flops_per_s"] / 494.7e12)
    # A peak the user gave always wins.
    rec2 = StepRecorder(rank=0, world_size=1, run_dir=None, log_every_steps=1, progress=False, profile=False)
    rec2.attach(nn.Linear(4, 4), TrainConfig(profile=False, progress=False, peak_flops=1e12), device=fake_gpu)
    rec2.add_tokens(1000)
    assert rec2.end_step()["mfu"] == pytest.approx(rec2.last_record["model_flops_per_s"] / 1e12)
