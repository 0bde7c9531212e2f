"""The report says what ``auto`` chose in the words of its console line (issue #46 item 5), with the
verification's verdict, not only "gradient sync auto"."""

from __future__ import annotations

import json

from slipstream.report.data import load_run
from slipstream.report.html import render_html

LINE = ("sync auto: powersgd rank 1 for 3 buckets (12.1 MB), allreduce for 1 (0.2 MB): predicted 41.0 ms per "
        "backward+sync against 97.0 ms with all-reduce, on the measured link (2 ranks, latency 0.21 ms, 1.000 "
        "Gbit/s); communication exposed: compressing where it lowers the predicted step")
KEPT = "kept: measured 43.2 ms per backward+sync against 96.1 ms uncompressed"


def _run(tmp_path, **fields):
    (tmp_path / "metrics").mkdir()
    recs = [{"step": s, "rank": 0, "time_s": 0.1 * s, "step_time_s": 0.1, "loss": 1.0, "sync_strategy": "auto",
             **fields} for s in (1, 2, 3)]
    (tmp_path / "metrics" / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return load_run(str(tmp_path))


def test_the_summary_shows_autos_decision_line_and_its_verification(tmp_path):
    page, _ = render_html(_run(tmp_path, sync_decision_line=LINE, sync_verification=KEPT,
                               sync_decision="allreduce:1,powersgd:3"))
    assert "<th>sync decision</th><td>" + LINE + "</td>" in page, page
    assert "<th>sync verification</th><td>" + KEPT + "</td>" in page


def test_a_run_recorded_before_the_line_shows_its_codec_counts(tmp_path):
    page, _ = render_html(_run(tmp_path, sync_decision="allreduce:1,powersgd:3"))
    assert "<th>sync decision</th><td>allreduce:1,powersgd:3</td>" in page


def test_a_fixed_strategy_gets_no_decision_row(tmp_path):
    page, _ = render_html(_run(tmp_path, sync_strategy="bf16", sync_decision="bf16"))
    assert "sync decision" not in page
