"""A refusal on some ranks only is agreed before the collective load (issue #32, item 5).

Each rank checks DCP's .metadata and reads its own rank file itself; a check
that fails on one rank only (a node-local copy, a rank file of its own) must
make every rank refuse, promptly and with that rank's reason, instead of
leaving the others in DCP's load (or in training) until the timeout.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed


class Value:
    def __init__(self, value: float) -> None:
        self.t = torch.full((4,), value)

    def state_dict(self) -> dict:
        return {"t": self.t}

    def load_state_dict(self, state: dict) -> None:
        self.t.copy_(state["t"])


def _manager(directory: str, verify: str = "full"):
    from slipstream.checkpoint.manager import CheckpointManager

    mgr = CheckpointManager(directory, handle_sigterm=False, verify=verify)
    mgr.register("value", Value(0.0))
    mgr.register("mine", Value(0.0), per_rank=True)
    return mgr


def _refuse_on_rank_1_only(rank: int, world: int, directory: str) -> dict:
    import pickle

    import torch.distributed as dist

    import slipstream
    from slipstream.checkpoint import safe_load
    from slipstream.checkpoint.safe_load import CheckpointRefused

    slipstream.init()
    mgr = _manager(directory)
    mgr._shared["value"].t.fill_(7.0)
    mgr._per_rank["mine"].t.fill_(float(rank))
    assert mgr.save(3)
    out: dict = {}

    # 1. DCP's .metadata refused on rank 1 alone (its node-local copy, say).
    real = safe_load._MetadataUnpickler.find_class
    if rank == 1:
        def refuse(self, module, name):
            raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata type")
        safe_load._MetadataUnpickler.find_class = refuse
    started = time.monotonic()
    try:
        out["metadata"] = ("loaded", _manager(directory).restore_latest())
    except CheckpointRefused as exc:
        out["metadata"] = ("refused", str(exc))
    out["metadata_s"] = time.monotonic() - started
    safe_load._MetadataUnpickler.find_class = real

    # 2. Rank 1's own rank file is damaged, its size kept (checkpoint_verify=size passes it).
    dist.barrier()
    if rank == 1:
        rank_file = os.path.join(directory, "step_00000003", "rank1.pt")
        size = os.path.getsize(rank_file)
        with open(rank_file, "wb") as f:
            f.write(b"x" * size)
    dist.barrier()
    started = time.monotonic()
    try:
        out["rank_file"] = ("loaded", _manager(directory, verify="size").restore_latest())
    except CheckpointRefused as exc:
        out["rank_file"] = ("refused", str(exc))
    out["rank_file_s"] = time.monotonic() - started
    slipstream.shutdown()
    return out


def test_a_refusal_on_one_rank_is_raised_on_every_rank_at_once(tmp_path):
    directory = str(tmp_path / "ckpt")
    results = run_ranks(_refuse_on_rank_1_only, 2, directory, env={"SLIPSTREAM_COLLECTIVE_TIMEOUT_S": "12"},
                        timeout_s=120)
    metadata = os.path.join(directory, "step_00000003", ".metadata")
    for out in results:
        outcome, message = out["metadata"]
        assert outcome == "refused", out
        assert message.startswith(f"rank 1: checkpoint file {metadata} holds more than checkpoint metadata"), message
        assert out["metadata_s"] < 6, out  # not the collective timeout (12 s)
        outcome, message = out["rank_file"]
        assert outcome == "refused", out
        assert message.startswith("rank 1: checkpoint file ") and "rank1.pt" in message, message
        assert out["rank_file_s"] < 6, out
    assert results[0]["metadata"] == results[1]["metadata"] and results[0]["rank_file"] == results[1]["rank_file"]
