"""Gradient clipping on the parallel layouts: O(1) all-reduces per clipped step, not one per
parameter, and still the whole model's norm.

The collectives are counted by torch's flight recorder (TORCH_FR_BUFFER_SIZE), which
records every collective the gloo backend runs, the c10d calls and DTensor's functional
collectives alike (a wrapper around ``dist.all_reduce`` would miss the latter).
"""

from __future__ import annotations

import os
import pickle

import pytest
from tests.harness import run_ranks
from tests.parallel.parallel_workers import CONTEXT, GLOBAL_BATCH, HEADS, example, global_batch, sgd_factory

pytestmark = pytest.mark.distributed

CLIP = 0.05
FR_ENV = {"TORCH_FR_BUFFER_SIZE": "20000"}


def _recorded() -> list[dict]:
    from torch._C._distributed_c10d import _dump_fr_trace

    return pickle.loads(_dump_fr_trace(includeStackTraces=False))["entries"]


def _all_reduces_in(fn) -> tuple[object, int]:
    """Run ``fn``; return its result and how many all-reduces this rank ran meanwhile."""
    before = {e["record_id"] for e in _recorded()}
    out = fn()
    new = [e for e in _recorded() if e["record_id"] not in before]
    return out, sum(1 for e in new if e["profiling_name"].split(":")[-1].startswith("all_reduce"))


def clip_worker(rank: int, world: int, layouts: list[dict], run_dir: str) -> list[dict]:
    """Per layout and model depth: all-reduces in one ``_clip_gradients``, its norm, and the
    norm of the full gradients gathered whole (torch's get_total_norm on full tensors)."""
    import torch

    import slipstream

    os.environ["SLIPSTREAM_RUN_DIR"] = run_dir
    slipstream.init()
    ex = example()
    out = []
    for layout in layouts:
        for layers in (1, 4):
            torch.manual_seed(0)
            model = ex.GPT(dim=32, layers=layers, heads=HEADS, context=CONTEXT)
            run = slipstream.accelerate(model, sgd_factory, tp_plan=ex.TP_PLAN, progress=False, profile=False,
                                        grad_clip_norm=CLIP, **layout)
            x, y = global_batch(0)
            per_rank = GLOBAL_BATCH // run.dp_size
            rows = slice(run.dp_rank * per_rank, (run.dp_rank + 1) * per_rank)
            run.backward(ex.loss_fn(run.model(x[rows]), y[rows]))
            grads = [p.grad for p in run.module.parameters() if p.grad is not None]
            full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
            expected = float(torch.nn.utils.get_total_norm(full))
            norm, n = _all_reduces_in(lambda: run._clip_gradients(CLIP))
            clipped = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
            out.append({"layout": dict(layout), "layers": layers, "tensors": len(grads), "all_reduces": n,
                        "norm": float(norm), "expected": expected,
                        "clipped_norm": float(torch.nn.utils.get_total_norm(clipped))})
            run.finish()
    slipstream.shutdown()
    return out


def _check(results, bound):
    for rows in zip(*results):
        for r in rows:
            name = f"{r['layout']} layers={r['layers']} ({r['tensors']} gradient tensors)"
            assert r["all_reduces"] <= bound, f"{name}: {r['all_reduces']} all-reduces in one clip"
            assert abs(r["norm"] - r["expected"]) <= 1e-5 * r["expected"], (name, r["norm"], r["expected"])
            assert abs(r["clipped_norm"] - CLIP) <= 1e-4 * CLIP, (name, r["clipped_norm"])
    # Independent of the model's size: 1 block and 4 blocks clip with as many collectives.
    for rank_rows in results:
        by_layout: dict[str, set[int]] = {}
        for r in rank_rows:
            by_layout.setdefault(str(r["layout"]), set()).add(r["all_reduces"])
        assert all(len(counts) == 1 for counts in by_layout.values()), by_layout


def test_two_rank_layouts_clip_with_one_all_reduce(tmp_path):
    layouts = [{"dp_shard": 2}, {"tp": 2}]
    results = run_ranks(clip_worker, 2, layouts, str(tmp_path), env=FR_ENV, timeout_s=240)
    _check(results, bound=1)


def test_fsdp_times_tp_clips_with_one_all_reduce_per_mesh_dimension(tmp_path):
    results = run_ranks(clip_worker, 4, [{"dp_shard": 2, "tp": 2}], str(tmp_path), env=FR_ENV, timeout_s=300)
    _check(results, bound=2)
