"""The issue-#14 target table of benchmarks/report.py: ratios inside one cell, and where they miss."""

from __future__ import annotations

import pytest

from benchmarks import report


def _rows(auto_step=0.3, auto_ttt=2.0, bf16=0.52, allreduce=1.01, limit_ms=250.0):
    return [
        {"system": "floor", "step_s": 0.2, "time_to_target_s": None},
        {"system": "ddp", "step_s": 1.0, "time_to_target_s": 10.0},
        {"system": "ddp_bf16", "step_s": 0.5, "time_to_target_s": 6.0},
        {"system": "ddp_powersgd", "step_s": 0.4, "time_to_target_s": None},  # faster, never reached
        {"system": "slipstream:auto", "step_s": auto_step, "time_to_target_s": auto_ttt, "limit_ms": limit_ms},
        {"system": "slipstream:bf16", "step_s": bf16, "time_to_target_s": 6.5},
        {"system": "slipstream:allreduce", "step_s": allreduce, "time_to_target_s": 10.0},
    ]


def test_every_ratio_against_its_own_peer():
    c = report.target_checks(_rows(), "mlp", "2x1", "1gbit")
    assert c["auto_x_best_peer"]["ratio"] == pytest.approx(0.3 / 0.4)  # the fastest peer, reached or not
    assert "ddp_powersgd" in c["auto_x_best_peer"]["detail"]
    assert c["auto_x_best_converging"]["ratio"] == pytest.approx(0.3 / 0.5)  # ddp_powersgd never reached it
    assert c["auto_x_ddp"]["ratio"] == pytest.approx(0.3)
    assert c["auto_ttt_x_best"]["ratio"] == pytest.approx(2.0 / 6.0)  # the first peer that reached it
    assert c["bf16_x_torch_bf16"]["ratio"] == pytest.approx(1.04) and c["bf16_x_torch_bf16"]["holds"] is False
    assert c["allreduce_x_ddp"]["holds"] is True
    assert c["auto_x_limit"]["ratio"] == pytest.approx(1.2) and c["auto_x_limit"]["holds"] is True


def test_misses_and_cells_without_a_limit_target():
    c = report.target_checks(_rows(auto_ttt=None, limit_ms=200.0), "mlp", "2x1", "200mbit")
    assert c["auto_ttt_x_best"]["holds"] is False and "did not reach" in c["auto_ttt_x_best"]["detail"]
    assert c["auto_x_limit"]["holds"] is False  # 300 ms against 200
    assert "auto_x_limit" not in report.target_checks(_rows(), "resnet", "2x1", "200mbit")
    assert "auto_x_limit" not in report.target_checks(_rows(), "mlp", "2x2", "1gbit")
    table = report.targets_table([("mlp", "2x1", "200mbit", _rows(auto_ttt=None, limit_ms=200.0))])
    assert "| mlp 2x1 @ 200mbit | 0.75 | 0.60 | 0.30 | MISS (not reached) | 1.04 MISS | 1.01 | 1.50 MISS |" in table


def _run(system, repeat, median, times):
    return {"system": system, "repeat": repeat, "median_step_s": median, "step_times_max_s": times}


def test_diagnostics_explain_a_miss_from_the_cell_itself():
    doc = {"runs": [
        _run("ddp", 0, 1.0, [1.2, 1.0, 1.0, 1.0, 1.0]), _run("ddp", 1, 1.1, [1.1] * 5),
        _run("ddp_hook_allreduce", 0, 1.05, [1.05] * 5),
        _run("slipstream:allreduce", 0, 1.092, [1.1] * 5),
        _run("slipstream:auto", 0, 0.5, [1.0, 2.0, 0.6, 0.5, 0.5]), _run("slipstream:auto", 1, 0.6, [1.0, 2.1, 0.7, 0.6, 0.6]),
    ]}
    rows = [{"system": "ddp", "step_s": 1.05, "time_to_target_s": 5.0},
            {"system": "ddp_hook_allreduce", "step_s": 1.05, "time_to_target_s": 5.2},  # not a peer
            {"system": "slipstream:allreduce", "step_s": 1.092, "time_to_target_s": 5.3},
            {"system": "slipstream:auto", "step_s": 0.55, "time_to_target_s": 5.6}]
    d = report.cell_diagnostics(doc, rows)
    assert d["hook_x_ddp"] == pytest.approx(1.0) and d["allreduce_x_hook"] == pytest.approx(1.04)
    assert d["ddp_spread"] == pytest.approx(1.1) and d["auto_spread"] == pytest.approx(1.2)
    assert d["first_peer"] == "ddp" and d["ttt_gap_s"] == pytest.approx(0.6)
    # auto's first 4 steps: 4.1 s and 4.4 s against 2.0 and 2.4 steady: 2.1 and 2.0 extra, median 2.05.
    assert d["auto_startup_s"] == pytest.approx(2.05) and d["peer_startup_s"] == pytest.approx(0.1, abs=1e-9)
    table = report.diagnostics_table([("mlp", "2x1", "unshaped", doc, rows)])
    assert "| mlp 2x1 @ unshaped | 1.00 | 1.04 | 1.10 | 1.20 | +0.60 | 2.05 / 0.10 (ddp) |" in table


def test_diagnostics_without_the_diagnostic_system_or_a_reaching_peer():
    doc = {"runs": [_run("ddp", 0, 1.0, [1.0] * 5)]}
    d = report.cell_diagnostics(doc, [{"system": "ddp", "step_s": 1.0, "time_to_target_s": None}])
    assert d["hook_x_ddp"] is None and d["ddp_spread"] is None and d["first_peer"] is None and d["ttt_gap_s"] is None
