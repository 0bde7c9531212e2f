"""gloo with CUDA tensors (``--backend gloo --device cuda``, how the GPU kit puts 2 and 4
ranks on one GPU) must never reach a collective gloo cannot carry for device tensors.

On the first H200 run every FSDP2 layout ended in SIGSEGV with no traceback: the full
state dict's gather went through DTensor's functional all-gather, which gloo's coalesced
path runs on device pointers (pytorch/pytorch#152645). Training itself used c10d's own
collectives, which gloo stages through the host. This test runs each mesh layout's whole
life on the CPU (train, checkpoint, resume, clip, gather the full state dict) under a
record of every collective and its group, and fails if one that gloo cannot carry for
device tensors reaches the training mesh's groups or the default group: the groups that
carry device tensors in that mode. Slipstream's host-gather groups (CPU copies) may.
"""

from __future__ import annotations

import pytest
from tests.harness import run_ranks
from tests.parallel.collective_log import UNCARRIED_ON_DEVICE
from tests.parallel.parallel_workers import collectives_worker

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "fsdp (dp_shard 4) + clipping": {"dp_shard": 4, "grad_clip_norm": 1.0},
    "fsdp zero2 (dp_shard 4)": {"dp_shard": 4, "zero_stage": 2},
    "tp 4": {"tp": 4},
    "dp_shard 2 x tp 2 + clipping": {"dp_shard": 2, "tp": 2, "grad_clip_norm": 1.0},
    "hsdp (dp_replicate 2 x dp_shard 2)": {"dp_replicate": 2, "dp_shard": 2},
    "diloco over 2 fsdp replicas": {"dp_replicate": 2, "dp_shard": 2, "sync": "diloco",
                                    "sync_options": {"inner_steps": 1}},
}


def test_no_layout_sends_device_tensors_where_gloo_cannot_carry_them(tmp_path):
    names = list(LAYOUTS)
    results = run_ranks(collectives_worker, 4, [LAYOUTS[n] for n in names], str(tmp_path), timeout_s=400)
    for i, name in enumerate(names):
        for rank, per_rank in enumerate(results):
            got = per_rank[i]
            bad = {k: v for k, v in got["device_groups"].items() if k[:2] in UNCARRIED_ON_DEVICE}
            assert not bad, f"{name}, rank {rank}: collectives gloo cannot carry for CUDA tensors on the " \
                            f"training groups: {bad}"
            assert got["device_groups"], f"{name}: no collective recorded at all (the log saw nothing)"
            assert len(got["losses"]) == 3 and got["keys"], (name, got["losses"])
        sharded = any(v for v in ("dp_shard", "tp") if LAYOUTS[name].get(v, 1) > 1)
        if sharded:  # the full state dict was gathered, through the host groups
            gathered = {k for k in results[0][i]["other_groups"] if k[1] == "all_gather_into_tensor"}
            assert gathered, f"{name}: no host gather seen: {results[0][i]['other_groups']}"
