"""benchmarks/low_comm.py: its figures from run records (no root), and its ``--quick`` mode on an
emulated cluster (root; must run in CI): every row has numbers, or for torchft the exact
error, and no namespace is left behind."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.low_comm import (
    check_targets,
    loop_step_s,
    parse_system,
    smoothed,
    target_loss,
    time_to,
)
from tests.conftest import require_root

ROOT = Path(__file__).resolve().parents[2]


def test_systems_parse_to_their_sync_and_options():
    assert parse_system("ddp").sync == "allreduce"
    assert parse_system("auto").sync == "auto"
    d = parse_system("diloco:50:bf16")
    assert (d.kind, d.sync, d.options, d.inner_steps) == ("diloco", "diloco", {"inner_steps": 50, "outer_codec": "bf16"}, 50)
    assert parse_system("diloco:50:bf16:tau5").options == {"inner_steps": 50, "outer_codec": "bf16", "overlap_steps": 5}
    assert parse_system("diloco:50:tau2").options == {"inner_steps": 50, "overlap_steps": 2}
    t = parse_system("torchft:100:perparam")
    assert (t.kind, t.inner_steps, t.options) == ("torchft", 100, {"per_param": True})
    assert parse_system("torchft:10").options == {"per_param": False}
    for bad in ("diloco", "diloco:x", "diloco:0", "diloco:50:tau0", "diloco:50:bf16:bf16", "torchft:5:bf16", "ddp:3", "Auto!"):
        with pytest.raises(ValueError, match="system"):
            parse_system(bad)


def test_step_time_target_and_time_to_target_from_records():
    records = [{"step": 10, "time_s": 2.0, "loss": 4.0}, {"step": 20, "time_s": 3.0, "loss": 3.0},
               {"step": 30, "time_s": 4.0, "loss": 2.0}, {"step": 40, "time_s": 5.0, "loss": 1.0}]
    assert loop_step_s(records) == pytest.approx(0.1)  # after the first window: (5 - 2) / (40 - 10)
    assert loop_step_s(records[:1]) == pytest.approx(0.2)
    curve = smoothed(records, 2)
    assert [c[2] for c in curve] == [4.0, 3.5, 2.5, 1.5]
    assert target_loss(curve, 40, 0.8) == 1.5  # the first record at or past step 32
    assert target_loss(curve, 40, 0.5) == 3.5
    assert time_to(curve, 3.5) == 3.0 and time_to(curve, 1.0) is None and time_to(curve, None) is None


def test_targets_compare_a_diloco_row_with_ddp():
    cell = {"systems": {
        "ddp": {"kind": "slipstream", "error": None, "bytes_per_token": 2000.0, "heldout_loss": 2.60, "utilisation": 0.2},
        "diloco:100": {"kind": "diloco", "error": None, "bytes_per_token": 19.0, "heldout_loss": 2.64, "utilisation": 0.93},
        "diloco:10": {"kind": "diloco", "error": None, "bytes_per_token": 210.0, "heldout_loss": 2.70, "utilisation": 0.7},
    }}
    check_targets(cell)
    good, bad = cell["systems"]["diloco:100"]["targets"], cell["systems"]["diloco:10"]["targets"]
    assert good["bytes_fewer_x"] == pytest.approx(2000 / 19) and good["bytes_ok"] and good["utilisation_ok"]
    assert good["heldout_ok"] and good["heldout_ratio"] == pytest.approx(2.64 / 2.60)
    assert not (bad["bytes_ok"] or bad["utilisation_ok"] or bad["heldout_ok"])
    assert "targets" not in cell["systems"]["ddp"]


def test_bad_options_are_one_line_errors():
    for args, text in ((["--systems", "ddp,diloco:7", "--steps", "400"], "multiple of H(7)"),
                       (["--clusters", "3x1", "--global-batch", "32"], "divide over the 3 ranks"),
                       (["--links", "100mbit,-5ms"], "delay")):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.low_comm", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and text in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.root
def test_quick_mode_measures_every_row(tmp_path, monkeypatch, capsys):
    """``--quick``: 10 steps of DDP and DiLoCo H=5 at 2x1, 100mbit,40ms (about 30 s), and torchft's
    row as where torchft cannot run: its error recorded, the run still a success. (A real torchft
    row costs ~12 s more; ``--quick`` alone, outside the tests, still runs it where torchft is
    installed.)"""
    require_root()
    from benchmarks import low_comm

    prefix = f"sslc{secrets.token_hex(2)}-"
    monkeypatch.setenv("SLIPSTREAM_EMULATE_NS_PREFIX", prefix)
    monkeypatch.setattr(low_comm, "torchft_unavailable", lambda procs: "torchft is hidden by the test")
    monkeypatch.chdir(ROOT)
    code = low_comm.main(["--quick", "--out", str(tmp_path)])
    stdout, stderr = capsys.readouterr()
    assert code == 0, stdout[-2000:] + stderr[-3000:]
    from slipstream.launch.emulate import list_namespaces

    assert list_namespaces(prefix) == []
    (path,) = tmp_path.glob("low-comm-*.json")
    doc = json.loads(path.read_text())
    (cell,) = doc["cells"]
    assert cell["floor_step_s"] > 0
    assert (cell["cluster"], cell["link"], cell["tokens"]) == ("2x1", "100mbit,40ms", 10 * 32 * 64)
    systems = cell["systems"]
    assert list(systems) == ["ddp", "diloco:5", "torchft:5", "floor"]
    ddp, diloco = systems["ddp"], systems["diloco:5"]
    assert systems["floor"]["utilisation"] == 1.0 and systems["floor"]["error"] is None
    for row in (ddp, diloco):
        assert row["error"] is None, row
        assert row["bytes_per_token"] > 0 and 0 < row["utilisation"] and row["heldout_loss"] > 0
    # One fp32 all-reduce of the 0.44M-parameter gradient a step: each node sends about its
    # 1.75 MB, so the link carries about 2 x 1.75 MB / 2048 tokens = 1,710 B/token, plus headers.
    assert 1500 < ddp["bytes_per_token"] < 2500, ddp["bytes_per_token"]
    assert diloco["bytes_per_token"] < ddp["bytes_per_token"] / 2
    ft = systems["torchft:5"]
    assert ft["error"] == "torchft is hidden by the test", ft  # why torchft could not run, and exit 0 all the same
    assert "| 2x1 | 100mbit,40ms | diloco:5 |" in stdout
