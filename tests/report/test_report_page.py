"""The report of a real run: a configuration section and learning-rate and gradient-norm plots,
checked in headless Chromium (the DOM it builds, and the pixels of its screenshot)."""

from __future__ import annotations

import html
import os
import re
import subprocess

import pytest

from slipstream.cli import main as cli_main
from tests.conftest import need_command
from tests.report.report_workers import LOG_EVERY, STEPS, train_with_schedule

CHROMIUM_HINT = "Debian: apt-get install -y chromium"


def _chromium() -> str:
    return need_command("chromium", hint=CHROMIUM_HINT)[0]


def _headless(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from tests.harness import run_ranks

    run_dir = str(tmp_path_factory.mktemp("report") / "run")
    run_ranks(train_with_schedule, 2, run_dir, timeout_s=170)
    out = os.path.join(run_dir, "report.html")
    assert cli_main(["report", run_dir]) == 0
    return run_dir, out


def test_config_is_recorded_and_shown_as_a_table(report):
    import json

    run_dir, out = report
    with open(os.path.join(run_dir, "metrics", "run.json")) as f:
        config = json.load(f)["config"]
    assert config["grad_clip_norm"] == 5.0 and config["total_steps"] == STEPS
    with open(out, encoding="utf-8") as f:
        page = f.read()
    section = page[page.index("<h2>Configuration</h2>"):]
    section = section[: section.index("</table>")]
    # Every recorded setting is a row; the ones changed from TrainConfig's defaults are marked.
    for name in config:
        assert f"<td>{html.escape(name)}</td>" in section, name
    assert re.search(r"<tr class='changed'><td>grad_clip_norm</td><td>5\.0</td><td>None</td></tr>", section), section
    assert re.search(r"<tr><td>precision</td><td>fp32</td><td></td></tr>", section)


def test_lr_and_grad_norm_are_plotted_from_the_records(report):
    from slipstream.report import load_run
    from slipstream.report.plots import grad_norm_figure, lr_figure

    run_dir, out = report
    run = load_run(run_dir)
    xs, lrs = run.series("lr")
    assert xs == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert lrs[0] == pytest.approx(0.1) and lrs[-1] == pytest.approx(0.1 * 0.5 ** 4)  # StepLR(6, 0.5) after 24
    fig = lr_figure(run)
    ((line_x, line_y),) = [(ln.get_xdata(), ln.get_ydata()) for ln in fig.axes[0].get_lines()]
    assert list(line_x) == xs and list(line_y) == lrs
    _, norms = run.series("grad_norm")
    assert len(norms) == len(xs) and all(n > 0 for n in norms)
    fig = grad_norm_figure(run)
    (line,) = fig.axes[0].get_lines()
    assert list(line.get_ydata()) == norms
    with open(out, encoding="utf-8") as f:
        page = f.read()
    for title in ("Learning rate", "Gradient norm"):
        assert f"<h2>{title}</h2>" in page, title
    assert {"lr.png", "grad_norm.png"} <= set(os.listdir(os.path.join(run_dir, "report")))


def test_page_in_chromium_shows_the_config_and_both_plots(report, tmp_path):
    """Chromium's own DOM: the sections are there and each plot's image decoded to a real size;
    its screenshot: the plots' region holds ink (a missing or broken image renders blank)."""
    _, out = report
    url = "file://" + os.path.abspath(out)
    dom = _headless("--virtual-time-budget=5000", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    page = dom.stdout
    assert "<h2>Configuration</h2>" in page and "<td>grad_clip_norm</td>" in page
    for key in ("lr", "grad_norm"):
        m = re.search(rf"<div class=\"fig\" id=\"fig-{key}\"><img alt=\"[^\"]+\" src=\"(data:image/svg\+xml;base64,[^\"]+)\"", page)
        assert m, key
    shot = str(tmp_path / "page.png")
    r = _headless("--window-size=1100,6000", f"--screenshot={shot}", url)
    assert os.path.exists(shot), r.stderr[-2000:]
    import matplotlib.image as mpimg
    import numpy as np

    from slipstream.report.plots import GRAD_NORM_COLOUR, LR_COLOUR

    img = (mpimg.imread(shot)[..., :3] * 255).astype(int)

    def pixels(hex_colour: str, tol: int = 12) -> int:
        rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
        return int((np.abs(img - rgb).max(axis=2) <= tol).sum())

    # Each new plot's line and markers (colours no other figure uses) are drawn on the page, and
    # the configuration's changed rows (their background, from the page's style sheet) show.
    assert pixels(LR_COLOUR) > 300, pixels(LR_COLOUR)
    assert pixels(GRAD_NORM_COLOUR) > 300, pixels(GRAD_NORM_COLOUR)
    changed_rows = pixels("#e8f1ff", tol=2)
    assert changed_rows > 4 * 100 * 10, changed_rows  # 5 changed rows here (grad_clip_norm, total_steps, ...)
    ink = (img.min(axis=2) < 240).mean()
    assert ink > 0.03, ink
