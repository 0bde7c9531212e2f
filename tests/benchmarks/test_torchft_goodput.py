"""benchmarks/torchft_goodput.py end to end, briefly: two torchft replicas and a lighthouse train a
few steps without kills, the row has its figures, and no process of the run is left behind."""

from __future__ import annotations

import json
import math

from benchmarks.torchft_goodput import RECOVERS_FROM, main
from tests.conftest import need_module


def test_a_short_run_without_kills_reports_a_row(tmp_path, capsys):
    need_module("torchft", "pip install torchft")
    out = tmp_path / "rows.json"
    assert main(["--replicas", "2", "--period-s", "0", "--steps", "4", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["exit_code"] == 0 and row["failures"] == 0 and row["last_committed_step"] == 4
    assert row["processes_started"] == 2 and row["replica_exits_on_their_own"] == []
    assert 0 < row["goodput"] <= 1.5 and row["median_step_s"] > 0
    assert math.isnan(row["fault_to_next_step_median_s"])
    assert f"| 2 | never | {RECOVERS_FROM} | 0 | 0 |" in capsys.readouterr().out
