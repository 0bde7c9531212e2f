"""Top-k's two selection paths on large buckets, both taken on the CPU (issue #42).

On the CPU a large bucket goes through a sampled threshold (``kthvalue`` on a
strided sample, then ``torch.topk`` on the values that pass); on a GPU every
bucket goes straight to ``torch.topk``. The GPU's path is forced here by
emptying ``topk.SAMPLED_SELECT_DEVICES`` (the name must exist, and the spy on
``kthvalue`` proves which path ran). Both must keep the same number of distinct
coordinates with the same magnitudes; where values tie with the k-th largest,
which of the tied coordinates is kept is the one documented freedom.
"""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.sync.compress import TopK, Wire
from slipstream.sync.compress import topk as topk_module

N = 1 << 18  # large: past SAMPLED_SELECT_MIN_NUMEL, so the CPU samples
DENSITY = 0.01


@pytest.fixture
def kthvalue_calls(monkeypatch):
    """How many times the sampled path's threshold was computed."""
    calls = []
    real = torch.Tensor.kthvalue
    monkeypatch.setattr(torch.Tensor, "kthvalue", lambda t, *a, **k: calls.append(t.numel()) or real(t, *a, **k))
    return calls


def _select(c: torch.Tensor, k: int, path: str, monkeypatch, calls: list) -> torch.Tensor:
    """TopK.select on the CPU through ``path`` ("sampled": the CPU's, "topk": the GPU's)."""
    devices = frozenset({"cpu"}) if path == "sampled" else frozenset()
    monkeypatch.setattr(topk_module, "SAMPLED_SELECT_DEVICES", devices)
    assert topk_module.sampled_select(c.device, c.numel(), k) == (path == "sampled"), "the patch did not take"
    before = len(calls)
    idx = TopK(DENSITY).select(c, k)
    assert (len(calls) > before) == (path == "sampled"), f"select did not take the {path} path"
    return idx


def _magnitudes(c: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.sort(c[idx].float().abs().nan_to_num(nan=math.inf)).values


def _bucket(kind: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(KINDS.index(kind))
    if kind == "normal":
        c = torch.randn(N, generator=g)
    elif kind == "rounded":  # few distinct values: many ties at the k-th largest
        c = torch.randn(N, generator=g).mul_(2).round_()
    elif kind == "mostly-zero":  # an embedding's gradient: rows without tokens are zero
        c = torch.zeros(N)
        c[torch.randperm(N, generator=g)[: N // 200]] = torch.randn(N // 200, generator=g)
    elif kind == "on-the-sample-stride":  # the large values exactly where the strided sample looks
        c = torch.randn(N, generator=g).mul_(1e-3)
        c[:: N // (1 << 15)] = torch.randn(1 << 15, generator=g).abs_().add_(1)
    elif kind == "off-the-sample-stride":  # and exactly where it does not
        c = torch.randn(N, generator=g).mul_(1e-3)
        c[1 :: N // (1 << 15)] = torch.randn(1 << 15, generator=g).abs_().add_(1)
    elif kind == "overflow":  # an fp16 step that overflowed: inf and NaN must be kept
        c = torch.randn(N, generator=g)
        c[[7, 70_000, N - 1]] = torch.tensor([math.inf, -math.inf, math.nan])
    elif kind == "many-nan":  # more NaN than k: the threshold itself is NaN
        c = torch.randn(N, generator=g)
        c[: N // 4] = math.nan
    else:
        raise ValueError(kind)
    return c.to(dtype)


KINDS = ["normal", "rounded", "mostly-zero", "on-the-sample-stride", "off-the-sample-stride", "overflow", "many-nan"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_both_paths_keep_k_distinct_coordinates_of_the_same_magnitudes(kind, dtype, monkeypatch, kthvalue_calls):
    c = _bucket(kind, dtype)
    k = TopK(DENSITY).k_of(N)
    sampled = _select(c, k, "sampled", monkeypatch, kthvalue_calls)
    full = _select(c, k, "topk", monkeypatch, kthvalue_calls)
    for name, idx in (("sampled", sampled), ("topk", full)):
        assert idx.numel() == k and idx.unique().numel() == k, f"{name}: {idx.unique().numel()} distinct of {k}"
    assert torch.equal(_magnitudes(c, sampled), _magnitudes(c, full)), "the paths kept different magnitudes"
    nonfinite = set((~torch.isfinite(c)).nonzero().view(-1).tolist())
    if 0 < len(nonfinite) <= k:  # an overflow reaches every rank through the kept values
        assert nonfinite <= set(sampled.tolist()) and nonfinite <= set(full.tolist())


def test_without_ties_both_paths_keep_the_same_coordinates_and_reduce_alike(monkeypatch, kthvalue_calls):
    """fp32 normal values have no ties: the sets, and so the whole reduction with its residual, are equal."""
    c = _bucket("normal", torch.float32)
    k = TopK(DENSITY).k_of(N)
    sampled = _select(c, k, "sampled", monkeypatch, kthvalue_calls)
    full = _select(c, k, "topk", monkeypatch, kthvalue_calls)
    assert set(sampled.tolist()) == set(full.tolist())
    results = {}
    for path in ("sampled", "topk"):
        monkeypatch.setattr(topk_module, "SAMPLED_SELECT_DEVICES", frozenset({"cpu"} if path == "sampled" else ()))
        codec = TopK(DENSITY)
        out = codec.reduce(c.clone(), Wire(None, size=1), key=0)
        results[path] = (out, codec.residuals[0].clone())
    assert torch.equal(results["sampled"][0], results["topk"][0])
    assert torch.equal(results["sampled"][1], results["topk"][1])


def test_the_gpu_never_takes_the_sampled_path():
    """Its count check reads a value on the host: on CUDA a host sync per bucket."""
    assert not topk_module.sampled_select(torch.device("cuda", 0), N, 100)
    assert topk_module.sampled_select(torch.device("cpu"), N, 100)
    assert not topk_module.sampled_select(torch.device("cpu"), topk_module.SAMPLED_SELECT_MIN_NUMEL - 1, 100)
    assert not topk_module.sampled_select(torch.device("cpu"), N, N // 4 + 1)  # most values kept: topk is cheap
