"""auto's convergence gate: a codec that keeps too little of the run's own gradient is not a
candidate, and the decision says why (single process: the measurement needs no collectives)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slipstream.network.link import Link
from slipstream.sync.accounting import StepRecord
from slipstream.sync.auto import AutoPolicy
from slipstream.sync.compress import make_codec
from slipstream.sync.compress.base import layout_from_shapes
from slipstream.sync.control import ControlWire
from slipstream.sync.options import DEFAULTS, SyncOptions
from slipstream.sync.policy import BucketInfo, convergence_gate, decide

ROOT = Path(__file__).resolve().parents[2]
SLOW = Link.measured(ranks=2, alpha_s=1e-4, bytes_per_s=25e6)  # 200 Mbit/s: compression pays


def _policy(**options) -> AutoPolicy:
    return AutoPolicy(SyncOptions(**options), ControlWire(None), world_size=2, link=SLOW, prober=lambda: SLOW)


def _step(grads: list[torch.Tensor]) -> tuple[StepRecord, dict]:
    """One observed step holding ``grads`` as its one bucket's reduced gradient."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    key = tuple(range(len(grads)))
    step = StepRecord(t_backward_start=None)
    step.numel[0], step.keys[0], step.outputs[0] = flat.numel(), key, flat
    return step, {key: layout_from_shapes([g.shape for g in grads])}


def test_gate_leaves_out_codecs_below_the_bar_and_never_allreduce():
    out = convergence_gate({"powersgd": 0.27, "bf16": 1.0, "topk": 0.5, "allreduce": 0.0}, 0.5)
    assert list(out) == ["powersgd"]
    assert "27%" in out["powersgd"] and "< 50%" in out["powersgd"]
    assert convergence_gate({"powersgd": 0.27}, 0.0) == {}  # 0 turns the gate off


def test_min_retained_is_an_auto_option_in_range():
    assert DEFAULTS.min_retained == 0.5
    assert SyncOptions.parse("auto", {"min_retained": 0.3}).min_retained == 0.3
    with pytest.raises(ValueError, match="min_retained"):
        SyncOptions(min_retained=1.5)
    with pytest.raises(TypeError, match="min_retained"):
        SyncOptions.parse("powersgd", {"min_retained": 0.3})  # a codec strategy has no gate


def test_measured_share_follows_the_gradients_rank():
    torch.manual_seed(0)
    low = torch.outer(torch.randn(256), torch.randn(256))  # rank 1: PowerSGD keeps all of it
    high = torch.randn(256, 256)  # full rank: rank 4 keeps a few percent
    auto = _policy(candidates=("allreduce", "bf16", "powersgd"))
    step, layouts = _step([low])
    kept = auto.measure_retained([0], step, torch.device("cpu"), layouts)
    assert kept["powersgd"] > 0.99 and kept["bf16"] > 0.99, kept
    step, layouts = _step([high])
    kept = auto.measure_retained([0], step, torch.device("cpu"), layouts)
    assert kept["powersgd"] < 0.2 and kept["bf16"] > 0.99, kept
    # Measuring must not touch the gradient it reads (it is DDP's bucket).
    assert torch.equal(step.outputs[0], high.reshape(-1))
    assert auto.measure_retained([0], StepRecord(t_backward_start=None), torch.device("cpu"), {}) == {}


def _resnet_gradient() -> list[torch.Tensor]:
    spec = importlib.util.spec_from_file_location("_gate_resnet", ROOT / "examples" / "train_resnet.py")
    ex = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ex
    spec.loader.exec_module(ex)
    torch.manual_seed(0)
    model = ex.ResNet18(width=16)
    x, y = ex.make_batch(2, 0, 32, 0)
    F.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()][::-1]


def test_resnet_gradient_keeps_powersgd_out_of_the_plan():
    """The case the gate is for: on the ResNet example's gradient PowerSGD keeps about a
    third of the energy, so at 200 Mbit/s, where it would be the fastest plan, auto plans
    the cast instead and says why."""
    grads = _resnet_gradient()
    auto = _policy()
    step, layouts = _step(grads)
    kept = auto.measure_retained([0], step, torch.device("cpu"), layouts)
    assert kept["powersgd"] < DEFAULTS.min_retained < kept["bf16"], kept
    numel = step.numel[0]
    layout = layouts[step.keys[0]]
    codecs = {n: make_codec(n) for n in ("allreduce", "bf16", "powersgd")}
    buckets = [BucketInfo(0, numel, 0.05, layout)]
    costs = {(0, "allreduce"): 0.0, (0, "bf16"): 0.001, (0, "powersgd"): 0.005}
    ungated = decide(buckets, SLOW, 2, costs, codecs)
    assert ungated.choices == {0: "powersgd"}  # fastest by the model alone
    gated = decide(buckets, SLOW, 2, costs, codecs, retained=kept, min_retained=DEFAULTS.min_retained)
    assert gated.choices == {0: "bf16"}, gated.explain()
    assert "powersgd" in gated.excluded and "convergence" in gated.explain()
    assert gated.retained == kept
