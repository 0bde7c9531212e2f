"""Loaded codec state and the comm thread's side stream (issue #32, item 3).

On GPUs the ordering thread runs every codec on its own CUDA stream. Residuals and
PowerSGD's Q factors loaded at resume are allocated on the default stream and then
read, overwritten and dropped on the side stream: unless they are recorded for the
side stream (``record_stream``), the caching allocator hands their blocks to the
backward while side-stream kernels still read them (wrong values on the first steps
after a resume, GPUs only). The test reproduces the class on the CPU: the job runs
with a stand-in for the CUDA stream API, and every tensor the load made must be
recorded for the stream the job runs on before a codec touches it.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.sync.accounting import StepRecord
from slipstream.sync.compress.base import layout_from_shapes
from slipstream.sync.compress.powersgd import PowerSGD
from slipstream.sync.compress.sign import ScaledSign
from slipstream.sync.compress.topk import TopK
from slipstream.sync.hierarchical import FlatReducer
from slipstream.sync.hooks import HookSync

SHAPES = [torch.Size([32, 16]), torch.Size([32]), torch.Size([8, 32]), torch.Size([8])]



class _SideStream:
    """Stands for the ordering thread's CUDA stream."""

    def wait_event(self, event):
        pass


class _Ready:
    """Stands for the CUDA event the backward records when a bucket is ready."""


def _engine(name, codec, group):
    return HookSync(name, FlatReducer(group), {name: codec}, name, control_group=group)


@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=2), lambda: TopK(density=0.1), lambda: ScaledSign(chunk_numel=8)],
                         ids=["powersgd", "topk", "sign"])
def test_loaded_state_is_recorded_for_the_side_stream(one_rank_group, monkeypatch, make):
    layout = layout_from_shapes(SHAPES)
    numel = sum(s.numel() for s in SHAPES)
    key = tuple(range(len(SHAPES)))
    g = torch.Generator().manual_seed(0)
    first = _engine(make().name, make(), one_rank_group)
    name = first.default
    for _ in range(2):  # residuals and warm-start factors to save
        first.reducer.reduce(torch.randn(numel, generator=g), first.codecs[name], key, layout)
    saved = first.state_dict()

    resumed = _engine(name, make(), one_rank_group)
    resumed.load_state_dict(saved)
    codec = resumed.codecs[name]
    loaded = list(codec.residuals.values()) + list(getattr(codec, "q", {}).values())
    assert loaded, "the codec kept no state to load"

    side = _SideStream()
    recorded: list[tuple[torch.Tensor, object]] = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: side)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: recorded.append((t, s)))
    # Checked when a codec first reads its state: by then every loaded tensor was recorded.
    seen: list[bool] = []
    compensate = type(codec)._compensate

    def watched(self, *a, **k):
        seen.append(all(any(t is r and s is side for r, s in recorded) for t in loaded))
        return compensate(self, *a, **k)

    monkeypatch.setattr(type(codec), "_compensate", watched)
    real_reduce = type(codec).reduce

    def reduce(self, *a, **k):
        if isinstance(self, PowerSGD):  # PowerSGD reads its residuals and Qs in reduce itself
            seen.append(all(any(t is r and s is side for r, s in recorded) for t in loaded))
        return real_reduce(self, *a, **k)

    monkeypatch.setattr(type(codec), "reduce", reduce)
    resumed._job(resumed.reducer, 0, key, torch.randn(numel, generator=g), name, layout,
                 StepRecord(t_backward_start=None), False, (0.0, _Ready()))
    missing = [tuple(t.shape) for t in loaded if not any(t is r and s is side for r, s in recorded)]
    assert not missing, f"loaded state not recorded for the side stream: {missing}"
    assert seen and all(seen)
