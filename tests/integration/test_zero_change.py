"""Zero-change acceleration at 2 ranks: `slipstream run --sync ...` on a plain DDP script.

The script (scripts_zero_change.py) is an unmodified torchrun DDP loop; the same file
with --mode accelerate wraps the same model with slipstream.accelerate().
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
REPO = HERE.parent.parent
SCRIPT = str(HERE / "scripts_zero_change.py")
ENV = {"OMP_NUM_THREADS": "1"}


def run(tmp_path: Path, name: str, *flags: str, script_args: tuple[str, ...] = (), timeout: float = 240,
        env: dict | None = None):
    out, run_dir = tmp_path / name, tmp_path / f"run-{name}"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream", "run", "-n", "2", "--run-dir", str(run_dir), *flags, SCRIPT,
         "--out", str(out), *script_args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **ENV, **(env or {})},
    )
    return proc, out, run_dir


def weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "model.pt")


def bitwise_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    proc, out, _ = run(tmp_path_factory.mktemp("plain"), "plain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "adopted" not in proc.stdout + proc.stderr  # no option: nothing installed
    return weights(out), json.loads((out / "result.json").read_text())["losses"]


def test_bf16_on_a_plain_ddp_script_equals_accelerate_bitwise(tmp_path, plain):
    proc, ours, run_dir = run(tmp_path, "ddp", "--sync", "bf16", "--log-every-steps", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "adopted the script's DistributedDataParallel (Sequential" in proc.stdout + proc.stderr
    assert "gradient sync bf16" in proc.stdout + proc.stderr
    proc, reference, _ = run(tmp_path, "accelerate", script_args=("--mode", "accelerate", "--sync", "bf16"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "adopted" not in proc.stdout + proc.stderr  # accelerate()'s own DDP is not adopted
    assert bitwise_equal(weights(ours), weights(reference))
    assert not bitwise_equal(weights(ours), plain[0])  # the strategy ran

    # Metrics as for an accelerate() script: every rank's records, the strategy's figures, the report.
    records = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12]
    assert records[0]["sync_strategy"] == "bf16" and records[0]["sync_compression_ratio"] == pytest.approx(2.0)
    assert records[0]["samples"] == 16 * 4 and records[0]["comm_exposed_s"] >= 0
    # the straggler exchange started at a log step is read at the next one (docs/metrics.md)
    assert "busy_s_ranks" not in records[0] and len(records[1]["busy_s_ranks"]) == 2
    assert (run_dir / "metrics" / "rank1.jsonl").exists() and (run_dir / "metrics" / "run.json").exists()
    report = subprocess.run([sys.executable, "-m", "slipstream", "report", str(run_dir)], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert report.returncode == 0, report.stderr[-2000:]
    assert "bf16" in report.stdout


@pytest.mark.parametrize("strategy", ["powersgd", "auto"])
def test_compressing_strategies_run_on_a_plain_ddp_script(tmp_path, plain, strategy):
    proc, out, run_dir = run(tmp_path, strategy, "--sync", strategy, "--log-every-steps", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"gradient sync {strategy}" in proc.stdout + proc.stderr
    losses = json.loads((out / "result.json").read_text())["losses"]
    assert all(map(torch.isfinite, torch.tensor(losses)))
    assert abs(losses[-1] - plain[1][-1]) <= 0.05 * plain[1][-1]
    last = json.loads((run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()[-1])
    assert last["sync_strategy"] == strategy and last["sync_decision"]
    if strategy == "powersgd":
        assert not bitwise_equal(weights(out), plain[0])
        assert last["sync_compression_ratio"] > 1


def test_a_hang_in_the_scripts_loop_gets_the_hang_report(tmp_path):
    proc, _, run_dir = run(tmp_path, "hang", "--sync", "bf16", "--collective-timeout-s", "6",
                           script_args=("--hang-at", "3"))
    assert proc.returncode != 0
    text = (run_dir / "hang.txt").read_text()
    assert "rank 1 stalled first" in text, text
    assert "rank 1 stalled first" in proc.stderr


def test_options_that_cannot_apply_are_named_at_start(tmp_path):
    proc, _, _ = run(tmp_path, "named", "--accumulate-steps", "2", "--checkpoint-dir", str(tmp_path / "ckpt"),
                     script_args=("--steps", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--accumulate-steps 2 not applied: the script's loop decides" in proc.stderr
    assert "--checkpoint-dir" in proc.stderr and "not applied" in proc.stderr
    assert not (tmp_path / "ckpt").exists()


def test_no_python_says_the_options_reach_only_accelerate(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "slipstream", "run", "-n", "1", "--no-python", "--sync", "bf16",
                           "--precision", "bf16", "true"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--sync, --precision with --no-python: training options reach only a slipstream.accelerate()" in proc.stderr


def test_collective_timeout_reaches_the_scripts_own_process_group(tmp_path):
    """--sync allreduce keeps DDP's reducer on the script's default group: only the group's own
    timeout (30 min by default) can end the hang, so the flag must have reached init_process_group."""
    proc, _, run_dir = run(tmp_path, "timeout", "--sync", "allreduce", "--collective-timeout-s", "5",
                           "--device", "cpu", script_args=("--hang-at", "3"), timeout=180)
    assert proc.returncode != 0
    assert "--device cpu not applied: the script places its model itself" in proc.stderr
    assert "rank 1 stalled first" in (run_dir / "hang.txt").read_text()


def test_a_bad_timeout_set_by_hand_is_one_line(tmp_path):
    """SLIPSTREAM_COLLECTIVE_TIMEOUT_S set in the environment (not through the checked flag) reaches the
    worker's init_process_group wrapper: a bad value is one line and exit 2, as slipstream.init() says it."""
    proc, _, _ = run(tmp_path, "badtimeout", "--sync", "bf16", script_args=("--steps", "1"), timeout=120,
                     env={"SLIPSTREAM_COLLECTIVE_TIMEOUT_S": "soon"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "SLIPSTREAM_COLLECTIVE_TIMEOUT_S must be a number of seconds > 0, got 'soon'" in proc.stderr
    assert "Traceback" not in proc.stderr
