"""Every parallel layout trains the GPT example to the single-process result.

The reference is plain PyTorch in this process on the whole global batch
(tests/parallel/parallel_workers.py); each layout runs under gloo in 2 or 4
processes. Tolerances: fp32 layouts differ from the reference only by the order
of floating-point reductions (sharded/all-reduced sums, split matmuls), so
losses must agree to 1e-4 and final weights to 1e-4 absolute; bf16 computes in
8-bit mantissas, so its losses must agree to 0.05 (and fall).
"""

from __future__ import annotations

import pytest
import torch
from tests.harness import run_ranks
from tests.parallel.parallel_workers import checkpoint_worker, global_losses, layouts_worker, reference

pytestmark = pytest.mark.distributed

STEPS = 4
LOSS_TOL = 1e-4
WEIGHT_TOL = 1e-4


CLIP = 0.05  # below every step's gradient norm here, so clipping acts on each step


@pytest.fixture(scope="module")
def ref_norms():
    """Each step's gradient norm: [unclipped reference, clipped reference]."""
    return [], []


@pytest.fixture(scope="module")
def ref(ref_norms):
    return reference(STEPS, grad_norms=ref_norms[0])


@pytest.fixture(scope="module")
def ref_clipped(ref_norms):
    return reference(STEPS, grad_clip_norm=CLIP, grad_norms=ref_norms[1])


def _check(name, results, ref_losses, ref_state, loss_tol=LOSS_TOL, weight_tol=WEIGHT_TOL):
    seen = global_losses(results)
    if "accumulate_steps" in name:
        assert seen[0::2] == seen[1::2], (name, seen)  # no step inside a window
        seen = seen[0::2]
    assert len(seen) == STEPS, (name, seen)
    assert max(abs(a - b) for a, b in zip(seen, ref_losses)) < loss_tol, (name, seen, ref_losses)
    state = results[0]["state"]
    assert set(state) == set(ref_state), (name, sorted(set(state) ^ set(ref_state)))
    worst = max((state[k].float() - ref_state[k]).abs().max().item() for k in ref_state)
    assert worst < weight_tol, (name, worst)
    assert torch.equal(state["tok.weight"], state["head.weight"]), f"{name}: the tied weights came apart"
    return seen


TWO_RANK_LAYOUTS = {
    "ddp (dp_replicate 2)": {},
    "fsdp (dp_shard 2)": {"dp_shard": 2},
    "fsdp zero2 (dp_shard 2)": {"dp_shard": 2, "zero_stage": 2},
    "tp 2": {"tp": 2},
    "pp 2 gpipe": {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 2},
    "pp 2 1f1b": {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4},
    "tp 2 + grad clipping": {"tp": 2, "grad_clip_norm": CLIP},
    # Each optimizer step sees its batch twice (the worker indexes data by step): the
    # mean of two equal micro-batch gradients is the reference's gradient.
    "fsdp 2 + accumulate_steps 2": {"dp_shard": 2, "accumulate_steps": 2},
    "pp 2 with an optimizer object (rebuilt)": {"pp": 2, "optimizer_object": True},
    # Every optimizer implementation on the layouts whose parameters are DTensors (each
    # layout above already takes torch's default, foreach, as on a GPU: tests/gpu_defaults.py).
    "tp 2 + fused AdamW": {"tp": 2, "optimizer_impl": "fused"},
    "tp 2 + for-loop AdamW": {"tp": 2, "optimizer_impl": "for-loop"},
    "tp 2 + a foreach AdamW object (rebuilt)": {"tp": 2, "optimizer_impl": "foreach", "optimizer_object": True},
    "fsdp 2 + fused AdamW": {"dp_shard": 2, "optimizer_impl": "fused"},
    # No DTensor rule for aten._fused_sgd_: runs unfused, with one line saying so.
    "tp 2 + fused SGD + grad clipping": {"tp": 2, "grad_clip_norm": CLIP, "optimizer_impl": "fused"},
}


def _check_grad_norm(name, results, norms):
    """The metrics' grad_norm on a sharded layout is the whole model's, on every rank."""
    for r in results:
        assert r["grad_norm"] is not None, name
        assert abs(r["grad_norm"] - norms[-1]) < 1e-4 * norms[-1], (name, r["grad_norm"], norms[-1])


def _layouts_match_single_process(layouts, world, refs, ref_norms, tmp_path, timeout_s):
    """Train every layout in one spawn of ``world`` ranks; each must match the single-process run."""
    ref, ref_clipped = refs
    names = list(layouts)
    results = run_ranks(layouts_worker, world, [layouts[n] for n in names], STEPS, str(tmp_path), timeout_s=timeout_s)
    for i, name in enumerate(names):
        ref_losses, ref_state = ref_clipped if "clip" in name else ref
        seen = _check(name, [r[i] for r in results], ref_losses, ref_state)
        if layouts[name].get("tp", 1) > 1:  # every parameter on the mesh, one mesh (clipping, foreach, fused)
            assert all(r[i]["plain_params"] == 0 and r[i]["meshes"] == 1 for r in results), \
                (name, [(r[i]["plain_params"], r[i]["meshes"]) for r in results])
        if layouts[name]:  # not plain DDP (there the recorder's own hook measures it)
            _check_grad_norm(name, [r[i] for r in results], ref_norms[1] if "clip" in name else ref_norms[0])
        print(f"{name}: {seen} (reference {ref_losses})")


def test_two_rank_layouts_match_single_process(ref, ref_clipped, ref_norms, tmp_path):
    _layouts_match_single_process(TWO_RANK_LAYOUTS, 2, (ref, ref_clipped), ref_norms, tmp_path, timeout_s=240)


FOUR_RANK_LAYOUTS = {
    "dp_shard 2 x tp 2": {"dp_shard": 2, "tp": 2},
    "pp 2 x dp_shard 2": {"pp": 2, "dp_shard": 2, "pp_microbatches": 2},
    "dp_replicate 2 x dp_shard 2 (HSDP)": {"dp_replicate": 2, "dp_shard": 2},
    "pp 2 x dp_shard 2 + grad clipping": {"pp": 2, "dp_shard": 2, "pp_microbatches": 2, "grad_clip_norm": CLIP},
    "dp_shard 2 x tp 2 + fused AdamW": {"dp_shard": 2, "tp": 2, "optimizer_impl": "fused"},
    "dp_shard 2 x tp 2 + for-loop AdamW + grad clipping": {"dp_shard": 2, "tp": 2, "optimizer_impl": "for-loop",
                                                            "grad_clip_norm": CLIP},
}


def test_two_dimensional_layouts_match_single_process(ref, ref_clipped, ref_norms, tmp_path):
    _layouts_match_single_process(FOUR_RANK_LAYOUTS, 4, (ref, ref_clipped), ref_norms, tmp_path, timeout_s=300)


def test_three_stage_pipeline_matches_single_process(ref, tmp_path):
    """A middle stage (no embeddings, no head), the tied weight summed between stages 0 and 2 only,
    default and explicit split points."""
    ref_losses, ref_state = ref
    layouts = {
        "pp 3 1f1b (default split)": {"pp": 3, "pp_microbatches": 4},
        "pp 3 gpipe (split at blocks.2, blocks.3)": {
            "pp": 3, "pp_schedule": "gpipe", "pp_microbatches": 2, "pp_split_points": ["blocks.2", "blocks.3"],
        },
    }
    results = run_ranks(layouts_worker, 3, list(layouts.values()), STEPS, str(tmp_path), timeout_s=240)
    for i, name in enumerate(layouts):
        seen = _check(name, [r[i] for r in results], ref_losses, ref_state)
        print(f"{name}: {seen} (reference {ref_losses})")


def test_bf16_and_activation_checkpointing_under_fsdp_and_tp(ref, tmp_path):
    ref_losses, _ = ref
    layouts = [
        {"dp_shard": 2, "precision": "bf16", "activation_checkpointing": ("Block",)},
        {"tp": 2, "precision": "bf16", "activation_checkpointing": ("Block",)},
        {"dp_shard": 2, "activation_checkpointing": ("Block",)},  # fp32 + recomputation: exact
    ]
    results = run_ranks(layouts_worker, 2, layouts, STEPS, str(tmp_path), timeout_s=240)
    for i, name in enumerate(("fsdp bf16+ac", "tp bf16+ac")):
        seen = global_losses([r[i] for r in results])
        print(f"{name}: {seen} (reference {ref_losses})")
        assert max(abs(a - b) for a, b in zip(seen, ref_losses)) < 0.05, (name, seen, ref_losses)
        assert seen[-1] < seen[0], (name, seen)
    exact = global_losses([r[2] for r in results])
    assert max(abs(a - b) for a, b in zip(exact, ref_losses)) < LOSS_TOL, (exact, ref_losses)


def test_checkpoint_reshards_across_layouts(ref, tmp_path):
    """fsdp 2 trains 2 steps and saves; tp 2 resumes for 1 step; pp 2 for 1 more; DDP loads the last.
    The chain must end where the uninterrupted reference ends (weights and optimizer state moved)."""
    ref_losses, ref_state = ref
    chain = [{"dp_shard": 2}, {"tp": 2}, {"pp": 2}, {}]
    steps = [2, 3, 4, 4]
    results = run_ranks(checkpoint_worker, 2, chain, steps, str(tmp_path / "ckpt"), str(tmp_path / "run"), timeout_s=240)
    starts = [results[0][i]["start"] for i in range(len(chain))]
    assert starts == [0, 2, 3, 4], starts
    seen = global_losses([r[0] for r in results]) + global_losses([r[1] for r in results]) + global_losses(
        [r[2] for r in results]
    )
    print(f"fsdp2 -> tp2 -> pp2: {seen} (reference {ref_losses})")
    assert max(abs(a - b) for a, b in zip(seen, ref_losses)) < LOSS_TOL, (seen, ref_losses)
    for i, name in ((2, "pp 2 after resume"), (3, "ddp loading the pp checkpoint")):
        state = results[0][i]["state"]
        worst = max((state[k].float() - ref_state[k]).abs().max().item() for k in ref_state)
        assert worst < WEIGHT_TOL, (name, worst)
