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
