"""The checks of healing in place, shared by test_heal_in_place.py and test_heal_chaos.py.

A case runs the fault-injection worker (scripts_ft_train.py) under ``slipstream run --heal``
with faults, beside an uninterrupted reference run of the same arguments, and checks:

* the final parameters and optimizer state are bitwise equal to the reference's;
* the sample ledger: the last time each rank ran step s it consumed the samples the
  reference consumed at step s, every step, no sample skipped or seen twice;
* every fault cost at most one step of redone work (ledger lines past the steps), or two
  where the caller says so;
* each dead rank was replaced in place (its supervisor's line, once per fault) and the
  launcher never stopped or restarted the workers (no "Sending process ... closing signal"),
  so the other ranks kept their processes;
* nothing is left running: no spare, no supervisor.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tests.integration.test_fault_tolerance import SCRIPT, launch

REPO = Path(__file__).resolve().parent.parent.parent


def ledger(out: Path, rank: int) -> list[tuple[int, int, int, int]]:
    lines = (out / f"ids_rank{rank}.log").read_text().split("\n")
    return [tuple(map(int, line.split())) for line in lines if line.strip()]  # type: ignore[misc]


def last_per_step(rows: list[tuple[int, int, int, int]]) -> dict[int, tuple[int, int]]:
    last: dict[int, tuple[int, int]] = {}
    for step, _world, first, final in rows:
        last[step] = (first, final)
    return last


def run_pair(tmp_path: Path, nproc: int, steps: int, fault: list[str], common: list[str] | None = None,
             launch_args: list[str] | None = None, env: dict | None = None,
             timeout_s: float = 300) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """The reference (no fault, no healing) and the healed run, side by side. ``fault``: the
    worker's fault arguments (the healed run only); ``common``: both runs' worker arguments;
    ``launch_args``: the healed run's launcher options besides ``--heal``."""
    ref_out, out = tmp_path / "ref", tmp_path / "healed"
    pids = tmp_path / "pids"
    pids.mkdir()
    common = ["--global-batch", "8", "--steps", str(steps), "--every", "100", *(common or [])]
    reference = subprocess.Popen(
        [sys.executable, "-m", "slipstream", "run", "--standalone", "-n", str(nproc), SCRIPT, "--out", str(ref_out),
         "--ckpt", str(tmp_path / "ref_ckpt"), *common],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # A snapshot every step: the checks bound the steps a fault redoes, and the measured cadence
    # (checkpoint/cadence.py, tested there and in test_heal_snapshots.py) picks K from timings, so a
    # fault after it decides could go back K steps (seen: 5 at 4 ranks, a kill inside a save at step 9).
    cadence = [] if "--snapshot-every-steps" in (launch_args or []) else ["--snapshot-every-steps", "1"]
    healed = launch("--standalone", "-n", str(nproc), "--heal", *cadence, *(launch_args or []), SCRIPT, "--out", str(out),
                    "--ckpt", str(tmp_path / "ckpt"), *fault, *common,
                    env={"SLIPSTREAM_HEAL_PID_DIR": str(pids), **(env or {})}, timeout=timeout_s)
    ref_log, _ = reference.communicate(timeout=timeout_s)
    assert reference.returncode == 0, ref_log[-3000:]
    return healed, ref_out, out


def assert_same_final(ref_out: Path, out: Path) -> None:
    """Bitwise: the final parameters and optimizer state of both runs: the worker's final.pt, or on
    a mesh layout (FSDP2, tp) each rank's final_rank{r}.pt (each rank holds its own shards)."""
    names = ["final.pt"] if (ref_out / "final.pt").exists() else sorted(p.name for p in ref_out.glob("final_rank*.pt"))
    assert names, f"no final state in {ref_out}"
    for file in names:
        ref = torch.load(ref_out / file, weights_only=True)
        got = torch.load(out / file, weights_only=True)
        assert ref["model"].keys() == got["model"].keys(), file
        for name, tensor in ref["model"].items():
            assert torch.equal(tensor, got["model"][name]), (file, name)
        assert ref["optimizer"]["state"].keys() == got["optimizer"]["state"].keys(), file
        for pid, state in ref["optimizer"]["state"].items():
            for key, value in state.items():
                other = got["optimizer"]["state"][pid][key]
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (file, pid, key)


def check(healed: subprocess.CompletedProcess, ref_out: Path, out: Path, nproc: int, steps: int,
          faults: int, markers: list[str] = (), redone_per_fault: int = 1) -> None:
    """Bitwise equal to the reference, ledger and all, after ``faults`` deaths each healed in
    place; ``markers``: files in ``out`` the worker wrote when it fired a fault (each fired);
    ``redone_per_fault``: the steps a fault may cost in ledger lines past ``steps``."""
    text = healed.stdout + healed.stderr
    assert healed.returncode == 0, text[-4000:]
    for marker in markers:
        assert (out / marker).exists(), f"{marker}: the fault never fired\n{text[-4000:]}"
    # Each dead rank was replaced in place by its supervisor, and every survivor healed.
    assert text.count("replacing it in place") == faults, text[-4000:]
    # Rank 0's survivor line; where rank 0 itself died while the group formed again, no survivor
    # of that heal is left to say it, and the replacements' resume line stands for it.
    assert "healed in place" in text or "resumed from an in-memory snapshot" in text, text[-4000:]
    assert "Sending process" not in text and "attempt 1" not in text.lower(), text[-4000:]  # no full restart
    assert_same_final(ref_out, out)
    # The sample ledger: the last run of every step used the reference's samples.
    for rank in range(nproc):
        expected = last_per_step(ledger(ref_out, rank))
        rows = ledger(out, rank)
        assert last_per_step(rows) == expected, rank
        assert sorted(expected) == list(range(steps))
        # At most redone_per_fault steps redone per fault (a dropped micro-step counts as one line too).
        assert len(rows) - steps <= faults * redone_per_fault, (rank, rows)


def no_leftovers(tmp_path: Path) -> None:
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "healed")], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}"
    spares = subprocess.run(["pgrep", "-f", "slipstream.launch.spare"], capture_output=True, text=True).stdout.split()
    mine = []
    for pid in spares:
        try:
            if str(tmp_path) in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace"):
                mine.append(pid)
        except OSError:  # ended meanwhile
            pass
    assert not mine, f"spares left behind: {mine}"
