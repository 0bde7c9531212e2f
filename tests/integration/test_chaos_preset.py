"""The chaos harness's CI preset: a worker kill, a launcher kill + relaunch and a SIGTERM
preemption on the GPT example at 2 ranks, each final state bitwise equal to the
uninterrupted run (benchmarks/chaos.py exits 1 on any miss)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
def test_short_preset_every_trial_is_bitwise_equal(tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.chaos", "--preset", "short", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.exists(), proc.stderr[-3000:]
    report = json.loads(out.read_text())
    trials = report["trials"]
    assert len(trials) == 3
    assert [t["faults"][0]["kind"] for t in trials] == ["worker_kill", "launcher_kill", "sigterm"]
    for t in trials:
        assert t["fault_injected"], t
        assert t["final_state"], t
        # Resumed from a checkpoint, not from scratch (seed 0: faults at steps 15, 16 and 11, a checkpoint every 7).
        assert t["faults"][0]["resumed_from"], t
    # The preempted launcher exits 143 (an emergency checkpoint, not a failure).
    assert trials[2]["faults"][0]["launcher_exit"] == 143, trials[2]
    missed = [f"trial {t['index']} ({t['faults'][0]['kind']}): {t['reason']}" for t in trials if not t["bitwise_equal"]]
    assert proc.returncode == (1 if missed else 0), proc.stderr[-3000:]
    assert not missed, "\n".join(missed) + "\n" + proc.stdout


def test_compare_states_counts_the_tensors_that_differ(tmp_path):
    import torch

    from benchmarks.chaos import compare_states

    a = {"w": torch.zeros(3), "b": torch.ones(2), "c": torch.arange(4.0)}
    b = {"w": torch.zeros(3), "b": torch.tensor([1.0, 1.5]), "c": torch.arange(4.0) + 1e-7}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    torch.save(dict(a), tmp_path / "a2.pt")
    same = compare_states(tmp_path / "a.pt", tmp_path / "a2.pt")
    assert same["bitwise_equal"] and same["tensors_differ"] == 0
    diff = compare_states(tmp_path / "a.pt", tmp_path / "b.pt")
    assert not diff["bitwise_equal"] and diff["tensors_differ"] == 2 and diff["max_abs_diff"] == 0.5
