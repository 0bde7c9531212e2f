"""``slipstream plan``'s low-communication rows (plan/lowcomm.py) and its DiLoCo recommendation."""

from __future__ import annotations

import json
import shlex

import pytest

from slipstream.cli import main
from slipstream.network.lowcomm import LOW_UTILISATION, DilocoSetting
from slipstream.plan.lowcomm import floor_s, low_comm
from slipstream.plan.planner import plan

# resnet50 (25,557,000 parameters) on 2 V100s in 2 nodes: compute-heavy, 102 MB of fp32 gradients.
RESNET = ("resnet50", 2, "V100")


def _plan(network: str):
    model, gpus, gpu = RESNET
    return plan(model, gpus=gpus, gpu_type=gpu, network=network, gpus_per_node=1)


def test_rows_at_100mbit_40ms_by_hand():
    result = _plan("100mbit,40ms")
    low = low_comm(result)
    assert low is not None and low.base.layout.label() == "ddp2"
    p = low.base.prediction
    assert floor_s(low.base) == pytest.approx(p.compute_s + p.optimizer_s)  # DDP: forward, backward, optimizer
    # One outer all-reduce on 2 ranks: 2 ring steps of 40 ms + 25,557,000 x 4 B at 100 Mbit/s x 0.8.
    outer = 2 * 0.040 + 25_557_000 * 4 / 1e7
    by = {r.estimate.setting: r for r in low.rows}
    for h in (10, 50, 100):
        e = by[DilocoSetting(h)].estimate
        assert e.outer_s == pytest.approx(outer)
        assert e.step_s == pytest.approx(floor_s(low.base) + outer / h)
    e = by[DilocoSetting(50, 5, "bf16")].estimate
    assert e.step_s == pytest.approx(floor_s(low.base) + 5 * (0.080 + 25_557_000 / 5 * 2 / 1e7) / 50)
    # Per-step #1 is at 5 %; H=100 reaches 31 %, no setting 80 %: the fastest is named.
    assert low.advice.per_step_utilisation < 0.1
    rec = low.advice.recommendation
    assert rec is not None and rec.setting == DilocoSetting(100)
    assert low.advice.speedup(rec) == pytest.approx(result.best.prediction.step_s / rec.step_s)
    # Time to train at the same steps as the per-step rows; DiLoCo's outer state on top of DDP's memory.
    steps = result.total_samples / result.global_batch
    assert by[DilocoSetting(100)].time_to_train_s == pytest.approx(steps * rec.step_s)
    assert by[DilocoSetting(100)].memory_bytes == pytest.approx(p.memory_bytes + 8 * 25_557_000)


def test_a_fast_link_gets_rows_but_no_recommendation():
    low = low_comm(_plan("100gbit-ib"))
    assert low is not None and len(low.rows) == 4
    assert low.advice.per_step_utilisation > LOW_UTILISATION
    assert low.advice.recommendation is None and "not below 50%" in low.advice.reason


def test_no_rows_without_a_plain_data_parallel_layout():
    assert low_comm(plan("resnet50", gpus=1, gpu_type="V100", network="1gbit")) is None


def _out(argv, capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert main(argv) == 0
    return capsys.readouterr().out


SLOW = ["plan", "--model", "resnet50", "--gpus", "2", "--gpus-per-node", "1", "--gpu-type", "V100",
        "--network", "100mbit,40ms", "--top", "3"]


@pytest.mark.parametrize("columns", [80, 120])
def test_the_recommendation_is_printed_with_its_command(columns, capsys, monkeypatch, tmp_path):
    from slipstream.cli import build_parser
    from slipstream.launch.cli import launch_options_from_args

    out = _out(SLOW, capsys, monkeypatch, columns)
    assert "Low-communication sync (DiLoCo)" in out and "diloco H=100 *" in out
    flat = " ".join(out.split())
    assert "recommend --sync diloco (inner_steps=100): predicted utilisation" in flat
    assert "changes the optimisation: check the loss (docs/sync.md" in flat
    assert "still communication-bound (under 80%)" in flat  # H=100 at 31 %: said so
    (cmd,) = [line for line in out.splitlines() if line.startswith("  slipstream run ")]
    chosen = [line for line in out.splitlines() if line.startswith("slipstream run ")]
    assert len(chosen) == 1 and "diloco" not in chosen[0]  # the chosen per-step layout's, as before
    for line in out.splitlines():  # only the lines to copy may be longer than the terminal
        assert line in (cmd, chosen[0]) or line.startswith("SLIPSTREAM_") or len(line) <= columns, (columns, line)
    words = shlex.split(cmd)
    assert words[words.index("--sync") + 1] == "diloco"
    assert json.loads(words[words.index("--sync-options") + 1]) == {"inner_steps": 100}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    opts = launch_options_from_args(build_parser(words[1:]).parse_args(words[1:]))
    opts.validate()  # slipstream run's own checks, the sync options' included


def test_no_recommendation_line_on_a_fast_link(capsys, monkeypatch):
    argv = [*SLOW]
    argv[argv.index("100mbit,40ms")] = "100gbit-ib"
    out = _out(argv, capsys, monkeypatch, 120)
    assert "Low-communication sync (DiLoCo)" in out and "recommend --sync diloco" not in out
    assert not any(line.startswith("  slipstream run") for line in out.splitlines())


def test_json_has_the_same_fields(capsys, monkeypatch):
    doc = json.loads(_out([*SLOW, "--json"], capsys, monkeypatch, 120))
    low = doc["low_communication"]
    assert low["layout"] == "ddp2" and low["per_step"]["utilisation"] < 0.1
    assert [e["setting"] for e in low["estimates"]] == ["diloco H=10", "diloco H=50", "diloco H=100",
                                                        "diloco H=50 F=5 bf16"]
    for e in low["estimates"]:
        assert {"step_s", "comm_per_step_s", "utilisation", "speedup", "time_to_train_s", "memory_gib",
                "fits"} <= set(e)
    rec = low["recommendation"]
    assert rec["setting"] == "diloco H=100" and rec["speedup"] >= 1.5
    assert "--sync diloco --sync-options '{\"inner_steps\": 100}'" in rec["run"]
    assert rec["line"].startswith("recommend --sync diloco") and low["rule"]["below_utilisation"] == 0.5
    fast = [*SLOW, "--json"]
    fast[fast.index("100mbit,40ms")] = "100gbit-ib"
    assert json.loads(_out(fast, capsys, monkeypatch, 120))["low_communication"]["recommendation"] is None
    one = ["plan", "--model", "resnet50", "--gpus", "1", "--gpu-type", "V100", "--network", "1gbit", "--json"]
    assert json.loads(_out(one, capsys, monkeypatch, 120))["low_communication"] is None
