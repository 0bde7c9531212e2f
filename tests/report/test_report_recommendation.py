"""The report's summary carries ``auto``'s DiLoCo recommendation when the run's records hold one."""

from __future__ import annotations

import json

from slipstream.report.data import load_run
from slipstream.report.html import render_html

LINE = ("recommend --sync diloco (inner_steps=50): predicted utilisation 89% against 11% for auto's plan "
        "(measured link), 8.2x the throughput: slipstream run --sync diloco --sync-options '{\"inner_steps\": 50}' ...")


def _run(tmp_path, recommendation):
    (tmp_path / "metrics").mkdir()
    recs = [{"step": s, "rank": 0, "time_s": 0.1 * s, "step_time_s": 0.1, "loss": 1.0, "sync_strategy": "auto",
             "sync_recommendation": recommendation} for s in (1, 2, 3)]
    (tmp_path / "metrics" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return load_run(str(tmp_path))


def test_the_summary_shows_the_recommendation(tmp_path):
    run = _run(tmp_path, LINE)
    assert run.summary()["sync_recommendation"] == LINE
    page, _ = render_html(run)
    assert "low-communication" in page and "recommend --sync diloco (inner_steps=50)" in page
    assert "{&quot;inner_steps&quot;: 50}" in page  # escaped as any other text


def test_no_row_without_one(tmp_path):
    page, _ = render_html(_run(tmp_path, None))
    assert "low-communication" not in page
