"""Healing in place on the mesh layouts: FSDP2 (dp_shard) and tensor parallelism x dp_shard.

Each case runs the fault-injection worker (tests/integration/scripts_ft_train.py) with a mesh
layout and SIGKILLs at chosen (rank, step) pairs beside an uninterrupted reference run on the same
layout, and checks, rank by rank (each rank holds its own shards):

* the final parameters (the whole model) and this rank's optimizer shards bitwise equal to the
  reference's;
* the sample ledger: the last time each rank ran step s it consumed the reference's samples;
* each dead rank was replaced in place by its supervisor, the others never were, and the
  launcher never stopped or restarted the workers (the survivors kept their processes);
* nothing is left running.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.integration.test_fault_tolerance import SCRIPT, launch
from tests.integration.heal_checks import last_per_step as _last_per_step
from tests.integration.heal_checks import ledger as _ledger
from tests.integration.heal_checks import no_leftovers as _no_leftovers

REPO = Path(__file__).resolve().parent.parent.parent
STEPS = 8


def _run_and_check(tmp_path: Path, nproc: int, kills: str, layout: list[str]) -> None:
    ref_out, out = tmp_path / "ref", tmp_path / "healed"
    common = ["--global-batch", "8", "--steps", str(STEPS), "--every", "100", *layout]
    reference = subprocess.Popen(
        [sys.executable, "-m", "slipstream", "run", "--standalone", "-n", str(nproc), SCRIPT, "--out", str(ref_out),
         "--ckpt", str(tmp_path / "ref_ckpt"), *common],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    healed = launch("--standalone", "-n", str(nproc), "--heal", "--snapshot-every-steps", "1", SCRIPT, "--out", str(out), "--ckpt",
                    str(tmp_path / "ckpt"), "--kill-at", kills, *common, timeout=300)
    ref_log, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_log[-3000:]
    text = healed.stdout + healed.stderr
    assert healed.returncode == 0, text[-4000:]
    assert "--heal:" not in text, text[-4000:]  # no refusal: this layout heals
    killed = [tuple(map(int, k.split(":"))) for k in kills.split(",")]
    # Each dead rank was replaced in place, once per kill, and no other: the survivors kept their processes.
    replaced = sorted(int(r) for r in re.findall(r"rank (\d+): the training process \(pid \d+\) died", text))
    assert replaced == sorted(rank for rank, _ in killed), text[-4000:]
    assert text.count("replacing it in place") == len(killed)
    assert "healed in place" in text
    assert "Sending process" not in text and "attempt 1" not in text.lower(), text[-4000:]  # no full restart
    for rank in range(nproc):
        ref = torch.load(ref_out / f"final_rank{rank}.pt", weights_only=True)
        got = torch.load(out / f"final_rank{rank}.pt", weights_only=True)
        for name, tensor in ref["model"].items():
            assert torch.equal(tensor, got["model"][name]), (rank, name)
        assert ref["optimizer"]["state"].keys() == got["optimizer"]["state"].keys()
        for pid, state in ref["optimizer"]["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(got["optimizer"]["state"][pid][key])), \
                    (rank, pid, key)
        expected = _last_per_step(_ledger(ref_out, rank))
        rows = _ledger(out, rank)
        assert _last_per_step(rows) == expected, rank
        assert sorted(expected) == list(range(STEPS))
        assert len(rows) - STEPS <= len(killed), (rank, rows)  # at most one step redone per kill
    for rank, step in killed:
        assert (out / f"killed_{rank}_{step}").exists()
    _no_leftovers(tmp_path)


def test_fsdp2_dp_shard_two_ranks_heals_two_kills_bitwise(tmp_path):
    _run_and_check(tmp_path, 2, "1:2,0:5", ["--dp-shard", "2"])


def test_tp_by_dp_shard_four_ranks_heals_bitwise(tmp_path):
    # tp 2 x dp_shard 2: DTensor parameters sharded over both mesh dimensions (FSDP2 over TP).
    _run_and_check(tmp_path, 4, "3:3", ["--dp-shard", "2", "--tp", "2"])
