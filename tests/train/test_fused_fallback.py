"""An optimizer whose fused kernel DTensor has no rule for runs unfused on mesh layouts, with one line.

torch 2.13 has DTensor sharding rules for fused Adam and AdamW, none for fused SGD or
Adagrad (``aten._fused_sgd_``: "does not have a sharding strategy registered", at the
first step). Slipstream finds that out before the first step and rebuilds the optimizer
unfused (foreach on a GPU), saying so once.
"""

from __future__ import annotations

import pytest
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


def _check(rank: int, world: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import slipstream
    from slipstream.train.optimizer_build import dtensor_lacks_fused_rule, without_unsupported_fused

    slipstream.init()
    mesh = init_device_mesh("cpu", (1,))
    plain = torch.nn.Parameter(torch.ones(4))
    dt = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    out = {
        "sgd fused dtensor": dtensor_lacks_fused_rule(torch.optim.SGD([dt], lr=0.1, fused=True)),
        "adamw fused dtensor": dtensor_lacks_fused_rule(torch.optim.AdamW([dt], lr=0.1, fused=True)),
        "sgd fused plain": dtensor_lacks_fused_rule(torch.optim.SGD([plain], lr=0.1, fused=True)),
        "sgd unfused dtensor": dtensor_lacks_fused_rule(torch.optim.SGD([dt], lr=0.1, momentum=0.9)),
    }
    opt, note = without_unsupported_fused(torch.optim.SGD([dt], lr=0.1, momentum=0.9, fused=True), "tp(2)")
    out["note"] = note
    out["rebuilt"] = (type(opt).__name__, opt.param_groups[0]["fused"], opt.param_groups[0]["momentum"],
                      opt.param_groups[0]["params"][0] is dt)
    dt.grad = distribute_tensor(torch.ones(4), mesh, [Replicate()])
    opt.step()  # runs: no "sharding strategy" error
    out["stepped"] = dt.to_local().tolist()
    stepped = torch.optim.SGD([dt], lr=0.1, fused=True)
    stepped.state[dt] = {"momentum_buffer": None}
    try:
        without_unsupported_fused(stepped, "tp(2)")
    except slipstream.ConfigError as exc:
        out["stepped_error"] = str(exc)
    slipstream.shutdown()
    return out


def test_fused_sgd_on_dtensors_is_rebuilt_unfused_with_one_line():
    out = run_ranks(_check, 1)[0]
    assert out["sgd fused dtensor"] == "aten._fused_sgd_"
    assert out["adamw fused dtensor"] is None  # torch has a rule: stays fused
    assert out["sgd fused plain"] is None and out["sgd unfused dtensor"] is None
    assert out["note"] and "\n" not in out["note"] and "aten._fused_sgd_" in out["note"] and "tp(2)" in out["note"]
    assert out["rebuilt"] == ("SGD", False, 0.9, True)
    assert out["stepped"] == pytest.approx([0.9] * 4)
    assert "has stepped already" in out["stepped_error"]
