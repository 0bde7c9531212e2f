"""Healing in place goes back to in-memory snapshots taken at a measured cadence, with or without a
checkpoint directory (``slipstream run --heal``).

A run with no ``checkpoint_dir`` keeps in-memory snapshots only (no disk writes), heals from them
bitwise equal to an uninterrupted run (sample ledger included), and leaves nothing in the
snapshots' tmpfs when it ends. The cadence rule itself: tests/checkpoint/test_cadence.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.integration.test_fault_tolerance import SCRIPT, launch
from tests.integration.heal_checks import REPO, assert_same_final
from tests.integration.heal_checks import last_per_step as _last_per_step
from tests.integration.heal_checks import ledger as _ledger
from tests.integration.heal_checks import no_leftovers as _no_leftovers
from tests.integration.test_heal_in_place import STEPS


def test_a_run_without_checkpoint_dir_heals_from_snapshots_bitwise(tmp_path):
    kills = "1:3,0:11"
    ref_out, out, shm = tmp_path / "ref", tmp_path / "healed", tmp_path / "shm"
    common = ["--global-batch", "8", "--steps", str(STEPS)]  # no --ckpt: no checkpoint_dir
    reference = subprocess.Popen(
        [sys.executable, "-m", "slipstream", "run", "--standalone", "-n", "2", SCRIPT, "--out", str(ref_out), *common],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    healed = launch("--standalone", "-n", "2", "--heal", SCRIPT, "--out", str(out), "--kill-at", kills, *common,
                    env={"SLIPSTREAM_SNAPSHOT_DIR": str(shm)}, timeout=300)
    ref_log, _ = reference.communicate(timeout=300)
    assert reference.returncode == 0, ref_log[-3000:]
    text = healed.stdout + healed.stderr
    assert healed.returncode == 0, text[-4000:]
    assert "there is no snapshot to go back to" not in text and "restarts every worker" not in text, text[-4000:]
    assert text.count("replacing it in place") == 2, text[-4000:]
    # Both heals went back to an in-memory snapshot, the only state this run kept.
    assert text.count("an in-memory snapshot (no checkpoint_dir)") >= 2, text[-4000:]
    assert "Sending process" not in text, text[-4000:]  # no full restart
    # The cadence was measured and said (once per rank-0 process and choice).
    chosen = [int(k) for k in re.findall(r"snapshots every (\d+) steps: stall [\d.]+ ms of a [\d.]+ ms step", text)]
    assert chosen, text[-4000:]
    assert_same_final(ref_out, out)  # bitwise: parameters and optimizer state
    # The sample ledger: the last run of every step used the reference's samples; each kill redid at
    # most one cadence's worth of steps.
    for rank in range(2):
        rows = _ledger(out, rank)
        assert _last_per_step(rows) == _last_per_step(_ledger(ref_out, rank)), rank
        assert len(rows) - STEPS <= 2 * max(chosen), (rank, rows)
    # No disk checkpoint anywhere, and nothing left in the snapshots' tmpfs once the run ended.
    assert not [p for p in tmp_path.rglob("step_*") if shm not in p.parents], list(tmp_path.rglob("step_*"))
    assert not [p for p in shm.rglob("*") if p.is_file()], list(shm.rglob("*"))
    _no_leftovers(tmp_path)
