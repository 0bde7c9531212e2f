"""--probe-memory's search on a machine with a GPU, taken on the CPU (issue #42).

The probe itself (one forward and backward per try, OutOfMemoryError meaning too
large) needs a GPU; the search around it does not. Here torch reports CUDA and a
stand-in decides which micro-batches fit: the answer must be the largest that
fits, found by doubling and then bisection, with no try past the limit.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.errors import UsageError
from slipstream.plan import probe
from slipstream.plan.costmodel import Layout
from slipstream.plan.specs import get_model


@pytest.fixture
def gpu(monkeypatch):
    tried: list[int] = []

    def install(largest_fitting: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(probe, "_fits", lambda model, layout, mb: tried.append(mb) or mb <= largest_fitting)
        return tried

    return install


@pytest.mark.parametrize(("fits", "limit", "expected"), [(37, 1024, 37), (1, 1024, 1), (0, 1024, 0), (64, 64, 64),
                                                          (5000, 100, 100)])
def test_the_largest_micro_batch_that_fits(gpu, fits, limit, expected):
    tried = gpu(fits)
    assert probe.probe_max_micro_batch(get_model("gpt-1.3b"), Layout(), limit=limit) == expected
    assert max(tried) <= limit and len(tried) == len(set(tried)), tried
    assert len(tried) <= 2 * limit.bit_length() + 1  # doubling then bisection: logarithmic


def test_a_model_that_is_not_a_transformer_is_refused_before_any_try(gpu):
    tried = gpu(8)
    with pytest.raises(UsageError, match="--probe-memory builds transformer layers; resnet50 is a cnn"):
        probe.probe_max_micro_batch(get_model("resnet50"), Layout())
    assert tried == []
