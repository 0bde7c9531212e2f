"""fp16 error feedback is carried in true-gradient units, not loss-scaled ones (issue #32, item 4).

With a GradScaler the gradients a comm hook receives are the true gradients times the
loss scale. A residual kept in those units is re-weighted by every change of the scale
(2x at each growth or backoff) when it is added to the next step's gradient. Two
engines see the same true gradients; one's scaler changes its scale between the steps
(``update(new_scale)``, as a backoff after an inf step does): the residuals, in true
units, and the true gradients delivered must be the same in both.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.sync.accounting import StepRecord
from slipstream.sync.compress.base import layout_from_shapes
from slipstream.sync.compress.powersgd import PowerSGD
from slipstream.sync.compress.topk import TopK
from slipstream.sync.hierarchical import FlatReducer
from slipstream.sync.hooks import HookSync
from slipstream.train.precision import loss_scale

SHAPES = [torch.Size([32, 16]), torch.Size([32]), torch.Size([8, 32]), torch.Size([8])]



def _scaler(init_scale: float) -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    scaler.scale(torch.ones(()))  # its scale tensor exists from the first scale() on
    return scaler


@pytest.mark.parametrize("make", [lambda: PowerSGD(rank=2), lambda: TopK(density=0.1)], ids=["powersgd", "topk"])
def test_residual_is_kept_in_true_gradient_units_across_a_scale_change(one_rank_group, make):
    layout = layout_from_shapes(SHAPES)
    numel = sum(s.numel() for s in SHAPES)
    key = tuple(range(len(SHAPES)))
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(numel, generator=g) for _ in range(2)]
    runs = {}
    for change in (False, True):
        name = make().name
        engine = HookSync(name, FlatReducer(one_rank_group), {name: make()}, name, control_group=one_rank_group)
        scaler = _scaler(2.0 ** 10)
        engine.use_loss_scale(lambda s=scaler: loss_scale(s))
        delivered, residuals = [], []
        for i, true in enumerate(grads):
            if i == 1 and change:
                scaler.update(new_scale=2.0 ** 6)
            scale = scaler.get_scale()  # the test reads it on the host; the engine does not
            out = engine._job(engine.reducer, 0, key, true * scale, name, layout,
                              StepRecord(t_backward_start=None), False, (0.0, None))
            delivered.append(out / scale)
            codec = engine.codecs[name]
            residuals.append(torch.cat([codec.residuals[("param", k)].reshape(-1) for k in (0, 2)]))
        runs[change] = delivered, residuals
    (d_same, r_same), (d_changed, r_changed) = runs[False], runs[True]
    # Residuals are in true units: the same whatever the scale was (and not the scale's multiple).
    for a, b in zip(r_same, r_changed):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert float(r_same[0].abs().max()) < 10 * float(grads[0].abs().max())
    # The true gradient delivered after the change: the same as without it.
    torch.testing.assert_close(d_changed[1], d_same[1], rtol=1e-5, atol=1e-6)


def test_the_facade_hands_its_scalers_scale_to_the_sync_engine():
    from tests.harness import run_ranks
    from tests.sync import _dtype_workers

    for r in run_ranks(_dtype_workers.fp16_facade_scale, 2, "topk"):
        assert r["same_tensor"], r
        assert all(torch.isfinite(torch.tensor(r["losses"]))), r
