"""The suite takes the GPU's optimizer defaults (tests/gpu_defaults.py), in pytest's process."""

from __future__ import annotations

import torch
from torch.optim.optimizer import _default_to_fused_or_foreach


def test_foreach_none_resolves_to_foreach_on_the_cpu_as_on_cuda():
    p = torch.nn.Parameter(torch.ones(3))
    assert _default_to_fused_or_foreach([p], differentiable=False) == (False, True)
    # fused only when asked, as on CUDA
    assert _default_to_fused_or_foreach([p], differentiable=False, use_fused=True) == (True, False)


def test_an_adamw_with_defaults_runs_its_foreach_implementation(monkeypatch):
    import torch.optim.adam as adam

    seen = []
    real = adam._multi_tensor_adam
    monkeypatch.setattr(adam, "_multi_tensor_adam", lambda *a, **k: seen.append(1) or real(*a, **k))
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    torch.optim.AdamW([p], lr=0.1).step()
    assert seen == [1]
