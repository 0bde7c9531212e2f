"""slipstream report: a self-contained page from a real 2-rank run, rendered in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from tests.conftest import need

from slipstream.cli import main as cli_main

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _chromium() -> str:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    need(False, "headless Chromium not found (Debian: apt-get install -y chromium)")
    raise AssertionError("not reached")


def render(html_path: str, png_path: str, height: int = 3000) -> list[str]:
    """Screenshot a page; return the console messages Chromium logged for it."""
    exe = _chromium()
    proc = subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
         "--v=0", f"--window-size=1100,{height}", f"--screenshot={png_path}", "file://" + os.path.abspath(html_path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert os.path.exists(png_path), proc.stderr[-2000:]
    return [line for line in proc.stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def not_blank(png_path: str) -> tuple[float, int]:
    """(fraction of pixels that are not white, number of distinct colours)."""
    import matplotlib.image as mpimg
    import numpy as np

    img = mpimg.imread(png_path)[..., :3]
    ink = float((img.min(axis=2) < 0.94).mean())
    colours = len(np.unique((img * 255).astype(np.uint8).reshape(-1, 3), axis=0))
    return ink, colours


@pytest.fixture(scope="module")
def report(two_rank_run, tmp_path_factory):
    run_dir = str(tmp_path_factory.mktemp("report") / "run")
    shutil.copytree(os.path.join(two_rank_run["base"], "straggler"), run_dir)
    # The hang-diagnosis hook: a run that hung leaves these two files behind.
    with open(os.path.join(run_dir, "hang.txt"), "w") as f:
        f.write("collective failed on rank 0 in backward of step 17 (timeout 30 s)\nrank 1 stalled first.\n")
    with open(os.path.join(run_dir, "hang.json"), "w") as f:
        json.dump({"reporting_rank": 0, "culprit": "rank 1 stalled first", "step": 17}, f)
    out = os.path.join(run_dir, "out", "page.html")
    assert cli_main(["report", run_dir, "--out", out]) == 0
    return run_dir, out


def test_page_is_self_contained_and_complete(report):
    run_dir, out = report
    with open(out, encoding="utf-8") as f:
        page = f.read()
    assert "<script" not in page.lower() and "<link" not in page.lower()
    for ref in re.findall(r"""(?:src|href)\s*=\s*['"]([^'"]+)""", page):
        assert ref.startswith("data:"), ref  # nothing fetched
    assert "@import" not in page and "url(" not in page
    for title in ("Loss", "Throughput", "Step-time breakdown", "Per-rank comparison", "Communication volume",
                  "Timeline (last steps)"):
        assert f"<h2>{title}</h2>" in page, title
    assert page.count("<img ") >= 5
    assert "rank 1 is" in page and "slower" in page  # the straggler verdict
    assert "Hang diagnosis" in page and "rank 1 stalled first" in page
    assert re.search(r"<th>ranks</th><td>2</td>", page)
    # PNG copies for a README, and the merged timeline for Perfetto.
    pngs = sorted(os.listdir(os.path.join(os.path.dirname(out), "report")))
    assert {"loss.png", "throughput.png", "breakdown.png", "ranks.png", "communication.png", "timeline.png"} <= set(pngs)
    for name in pngs:
        with open(os.path.join(os.path.dirname(out), "report", name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(run_dir, "timeline.json")) as f:
        trace = json.load(f)
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}


def test_page_renders_in_headless_chromium(report, tmp_path):
    _, out = report
    shot = str(tmp_path / "page.png")
    console = render(out, shot)
    assert console == [], console
    ink, colours = not_blank(shot)
    assert ink > 0.05 and colours > 50, (ink, colours)


def test_render_check_catches_script_errors_and_blank_pages(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>throw new Error('boom-in-page')</script></body></html>")
    console = render(str(bad), str(tmp_path / "bad.png"), height=600)
    assert any("boom-in-page" in line for line in console), console
    ink, colours = not_blank(str(tmp_path / "bad.png"))
    assert ink < 0.01 and colours < 10


def test_report_of_a_missing_or_empty_directory_is_a_usage_error(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "nope")]) == 2
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "no metrics" in capsys.readouterr().err


def test_report_skips_a_line_cut_short(two_rank_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(os.path.join(two_rank_run["base"], "control"), run_dir)
    with open(run_dir / "metrics" / "rank0.jsonl", "a") as f:
        f.write('{"step": 99, "loss": 1.')  # a crash mid-write
    from slipstream.report import load_run

    run = load_run(str(run_dir))
    assert run.bad_lines == 1 and max(r["step"] for r in run.ranks[0]) < 99
    assert run.summary()["ranks"] == 2


def test_missing_chromium_fails_in_ci_instead_of_skipping(monkeypatch):
    me = sys.modules[__name__]
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        me._chromium()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        me._chromium()
