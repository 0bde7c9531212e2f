"""One facade over both layouts: the shared checks run once, in accelerate(), before any
layout is built; the same loop runs on the data-parallel and the mesh layout (2 ranks, gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

LAYOUTS = {"data parallel": {}, "mesh (dp_shard 2)": {"dp_shard": 2}}
PER_RANK = 6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def checks_worker(rank: int, world: int, layouts: list[dict], run_dir: str) -> list[dict]:
    """Per layout: how often each shared check ran, and what one step reported."""
    import slipstream
    from slipstream import ConfigError
    from slipstream.train import facade, layout_dp, layout_mesh

    slipstream.init()
    calls = {"foreign_parameters": 0, "layouts_built": 0}
    real_foreign = facade.foreign_parameters

    def counting_foreign(*args):
        calls["foreign_parameters"] += 1
        return real_foreign(*args)

    def counting(cls):
        real_init = cls.__init__

        def init(self, *args, **kwargs):
            calls["layouts_built"] += 1
            real_init(self, *args, **kwargs)

        cls.__init__ = init

    facade.foreign_parameters = counting_foreign
    counting(layout_dp.DataParallelLayout)
    counting(layout_mesh.MeshLayout)
    out = []
    for options in layouts:
        calls.update(foreign_parameters=0, layouts_built=0)
        row: dict = {}
        model = _model()
        with_foreign = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(1))], lr=0.1)
        try:
            slipstream.accelerate(model, with_foreign, progress=False, run_dir=run_dir, **options)
        except ConfigError as exc:
            row["foreign"] = (str(exc), dict(calls))
        calls.update(foreign_parameters=0, layouts_built=0)
        try:
            slipstream.accelerate(_model(), lambda p: torch.optim.SGD(p, lr=0.1), progress=False, run_dir=run_dir,
                                  extra_state={"sampler": object()}, **options)
        except ConfigError as exc:
            row["extra_state"] = (str(exc), dict(calls))
        calls.update(foreign_parameters=0, layouts_built=0)
        model = _model()
        run = slipstream.accelerate(model, torch.optim.SGD(model.parameters(), lr=0.1), progress=False,
                                    run_dir=run_dir, log_every_steps=1, **options)
        row["built"] = dict(calls)
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(PER_RANK, 4, generator=g), torch.randint(0, 2, (PER_RANK,), generator=g)
        run.backward(F.cross_entropy(run.model(x), y))
        result = run.step()
        row["result"] = (result.stepped, result.step, result.logged, result.saved, result.stop_requested)
        row["samples"] = run.recorder.last_record["samples"]
        row["grad_norm"] = float(run.last_grad_norm)
        row["layout"] = run.describe_layout()
        run.finish()
        out.append(row)
    slipstream.shutdown()
    return out


def test_shared_checks_run_once_in_accelerate_for_both_layouts(tmp_path):
    results = run_ranks(checks_worker, 2, list(LAYOUTS.values()), str(tmp_path), timeout_s=240)
    for rank_rows in results:
        for name, row in zip(LAYOUTS, rank_rows):
            message, calls = row["foreign"]
            assert "1 parameter(s) that are not in the model" in message, name
            assert calls == {"foreign_parameters": 1, "layouts_built": 0}, (name, calls)  # refused before building
            message, calls = row["extra_state"]
            assert "set checkpoint_dir too" in message, name
            assert calls == {"foreign_parameters": 0, "layouts_built": 0}, (name, calls)
            assert row["built"] == {"foreign_parameters": 1, "layouts_built": 1}, (name, row["built"])
            # One step, logged (log_every_steps=1): the samples were counted once, not by two wrappers.
            assert row["result"] == (True, 1, True, False, False), (name, row["result"])
            assert row["samples"] == PER_RANK, (name, row["samples"])
            assert row["grad_norm"] > 0, name
    # The whole model's gradient norm, the same on both layouts and every rank.
    norms = [row["grad_norm"] for rank_rows in results for row in rank_rows]
    assert max(norms) - min(norms) <= 1e-5 * max(norms), norms
    assert [row["layout"] for row in results[0]] == [
        "pp(1) x dp_replicate(2) x dp_shard(1) x tp(1)", "pp(1) x dp_replicate(1) x dp_shard(2) x tp(1)"]
