import math

import numpy as np
import pytest
import torch

from slipstream.errors import ConfigError
from slipstream.train.lamb import LAMB, scaled_lr, warmup_schedule


def reference_lamb(w, grads, lr, b1, b2, eps, wd, max_trust):
    """LAMB written out in numpy, step by step, from the paper's Algorithm 2."""
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + wd * w
        wn, rn = np.linalg.norm(w), np.linalg.norm(r)
        trust = min(wn / rn, max_trust) if wn > 0 and rn > 0 else 1.0
        w = w - lr * trust * r
    return w


def test_lamb_matches_reference_update():
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 4))
    grads = [rng.normal(size=(3, 4)) for _ in range(3)]
    p = torch.nn.Parameter(torch.tensor(w0, dtype=torch.float64))
    opt = LAMB([p], lr=0.1, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, max_trust_ratio=10.0)
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    expected = reference_lamb(w0, grads, 0.1, 0.9, 0.99, 1e-6, 0.01, 10.0)
    np.testing.assert_allclose(p.detach().numpy(), expected, rtol=1e-10, atol=1e-12)


def test_lamb_zero_weights_use_trust_one():
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = LAMB([p], lr=0.5, weight_decay=0.0)
    p.grad = torch.ones(4, dtype=torch.float64)
    opt.step()
    # First Adam step of a constant gradient is ~1 per element; trust 1 (||w|| = 0).
    np.testing.assert_allclose(p.detach().numpy(), -0.5 * np.ones(4), rtol=1e-5)


def test_lamb_bad_arguments():
    with pytest.raises(ConfigError, match="lr must be > 0, got 0"):
        LAMB([torch.nn.Parameter(torch.zeros(1))], lr=0)


def test_linear_scaling_and_warmup():
    assert scaled_lr(0.1, global_batch=1024, base_batch=256) == pytest.approx(0.4)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = warmup_schedule(opt, warmup_steps=4, total_steps=12, decay="cosine")
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[8] == pytest.approx(0.5 * (1 + math.cos(math.pi * 4 / 8)))
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))


def test_warmup_needs_total_steps_for_decay():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ConfigError, match="needs total_steps"):
        warmup_schedule(opt, warmup_steps=2, decay="linear")
