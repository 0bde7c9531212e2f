"""Build the self-contained HTML report of a run directory.

One file, nothing fetched: the figures are SVG documents embedded as
``data:`` URIs (each isolated, so their element ids cannot collide), the
styles are inline, there is no script. PNG copies of every figure are written
next to it for a README.

Example::

    html_path, pngs = write_report("runs/x")            # runs/x/report.html, runs/x/report/*.png
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
import os
from typing import Any

from .data import Run, load_run
from .plots import FIGURES, PHASE_COLOURS

_CSS = """
body{font-family:-apple-system,'Segoe UI',Roboto,'Helvetica Neue',Arial,sans-serif;margin:24px auto;max-width:1000px;
color:#222;background:#fff;padding:0 16px}
h1{font-size:22px;margin-bottom:4px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;font-size:13px}table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ddd;padding:4px 10px;text-align:left;vertical-align:top}th{background:#f4f6f8}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.fig{margin:10px 0}.fig img{max-width:100%;border:1px solid #eee}
.alert{background:#fff3f3;border:1px solid #e0a0a0;padding:8px 12px;border-radius:4px}
.warn{background:#fffbe8;border:1px solid #e0d090;padding:8px 12px;border-radius:4px}
tr.changed td{font-weight:600;background:#e8f1ff}
pre{background:#f7f7f7;padding:8px;overflow-x:auto;font-size:12px}
.sw{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
"""


def _fmt_bytes(n: float | None) -> str:
    if not n:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return "n/a"
    if kind == "bytes":
        return _fmt_bytes(value)
    if kind == "ms":
        return f"{value * 1e3:.2f} ms"
    if kind == "pct":
        return f"{value * 100:.1f} %"
    if kind == "s":
        return f"{value:.1f} s"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return html.escape(str(value))


def _figure_payloads(run: Run, png_dir: str | None) -> list[tuple[str, str, str, str | None]]:
    """(key, title, svg data URI, png path) per figure with data."""
    import matplotlib.pyplot as plt

    out = []
    for key, title, build in FIGURES:
        fig = build(run)
        if fig is None:
            continue
        buf = io.BytesIO()
        fig.savefig(buf, format="svg")
        uri = "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
        png = None
        if png_dir is not None:
            os.makedirs(png_dir, exist_ok=True)
            png = os.path.join(png_dir, f"{key}.png")
            fig.savefig(png, format="png", dpi=110)
        plt.close(fig)
        out.append((key, title, uri, png))
    return out


def _summary_rows(run: Run, s: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [
        ("ranks", _fmt(s["ranks"])),
        ("steps", _fmt(s["steps"])),
        ("elapsed", _fmt(s["elapsed_s"], "s")),
        ("final loss", _fmt(s["final_loss"])),
        ("samples / s (job)", _fmt(s["samples_per_s"])),
        ("tokens / s (job)", _fmt(s["tokens_per_s"])),
        ("step time", _fmt(s["step_time_s"], "ms")),
    ]
    if s.get("model_flops_per_s"):
        rows.append(("model FLOP/s per rank", f"{s['model_flops_per_s'] / 1e12:.3f} TFLOP/s"))
    rows.append(("MFU", _fmt(s["mfu"], "pct") if s.get("mfu") is not None else "n/a (peak FLOP/s or model FLOPs unknown)"))
    rows += [
        ("peak process RSS", _fmt(s["mem_rss_bytes_max"], "bytes")),
        ("peak CUDA allocated / reserved",
         f"{_fmt(s['cuda_peak_allocated_bytes'], 'bytes')} / {_fmt(s['cuda_peak_reserved_bytes'], 'bytes')}"),
        ("gradient sync", _fmt(s["sync_strategy"])),
        *_decision_rows(s),
        ("bytes sent (all ranks)", _fmt(s["sync_bytes_sent_total"], "bytes")),
        ("compression ratio", _fmt(s["sync_compression_ratio"])),
        *([("low-communication", _fmt(s["sync_recommendation"]))] if s.get("sync_recommendation") else []),
        ("straggler", _fmt(s["straggler"]) if s["straggler"] else "none detected"),
        ("hang", "see below" if s["hang"] else "none recorded"),
    ]
    return rows


def _decision_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """What ``auto`` chose, in the words of its console line at decision time, and its
    verification's verdict; a run from before that line was recorded shows the codec counts."""
    rows = []
    if s.get("sync_decision_line"):
        rows.append(("sync decision", _fmt(s["sync_decision_line"])))
    elif s.get("sync_decision") and s.get("sync_decision") != s.get("sync_strategy"):
        rows.append(("sync decision", _fmt(s["sync_decision"])))
    if s.get("sync_verification"):
        rows.append(("sync verification", _fmt(s["sync_verification"])))
    return rows


def _phase_table(run: Run) -> str:
    keys = list(PHASE_COLOURS)
    head = "".join(
        f"<th><span class='sw' style='background:{PHASE_COLOURS[k]}'></span>{k[:-2]}</th>" for k in keys
    )
    body = []
    for r in run.ranks:
        means = run.phase_means(r)
        busy = run.steady("busy_s", r)
        step = run.steady("step_time_s", r)
        cells = "".join(f"<td class='num'>{means[k] * 1e3:.2f}</td>" for k in keys)
        body.append(
            f"<tr><td>{r}</td>{cells}<td class='num'>{(busy or 0) * 1e3:.2f}</td>"
            f"<td class='num'>{(step or 0) * 1e3:.2f}</td></tr>"
        )
    note = (
        "<p class='sub'>Milliseconds per step, median over the log windows after the first. "
        "busy = data wait + forward + backward + optimizer (time outside gradient synchronisation).</p>"
    )
    return "<table><tr><th>rank</th>" + head + "<th>busy</th><th>step</th></tr>" + "".join(body) + "</table>" + note


_UNKNOWN = object()


def _config_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


def _config_table(config: dict[str, Any]) -> str:
    """The run's TrainConfig (``metrics/run.json``, by flat name) as a table; a setting changed
    from TrainConfig's default is marked and its default shown beside it."""
    from ..config import TrainConfig

    defaults = TrainConfig().flat()
    rows = []
    for name, value in config.items():
        default = defaults.get(name, _UNKNOWN)
        changed = default is _UNKNOWN or _config_text(default) != _config_text(value)
        shown = "" if not changed else "?" if default is _UNKNOWN else _config_text(default)
        rows.append(f"<tr{' class=' + repr('changed') if changed else ''}><td>{html.escape(name)}</td>"
                    f"<td>{html.escape(_config_text(value))}</td><td>{html.escape(shown)}</td></tr>")
    return ("<table><tr><th>setting</th><th>value</th><th>default, where changed</th></tr>" + "".join(rows)
            + "</table><p class='sub'>TrainConfig by flat name (<code>grad_clip_norm</code>: flag "
            "<code>--grad-clip-norm</code>, variable <code>SLIPSTREAM_GRAD_CLIP_NORM</code>), as rank 0 "
            "recorded it in metrics/run.json; bold: changed from the default.</p>")


def render_html(run: Run, png_dir: str | None = None) -> tuple[str, list[str]]:
    """The page as a string, and the PNG paths written (when ``png_dir`` is given)."""
    s = run.summary()
    figures = _figure_payloads(run, png_dir)
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>Slipstream run report: {html.escape(os.path.basename(os.path.abspath(run.run_dir)))}</title>",
        f"<style>{_CSS}</style></head><body>",
        (
            f"<h1>Slipstream run report</h1><div class='sub'>{html.escape(os.path.abspath(run.run_dir))} &middot; "
            f"generated {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}</div>"
        ),
    ]
    if s["hang"]:
        parts.append(f"<h2>Hang diagnosis</h2><div class='alert'><pre>{html.escape(s['hang'])}</pre></div>")
        if run.hang is not None:
            parts.append(f"<details><summary>hang.json</summary><pre>{html.escape(json.dumps(run.hang, indent=1)[:20000])}</pre></details>")
    if s["straggler"]:
        parts.append(f"<div class='warn'>{html.escape(s['straggler'])}</div>")
    parts.append("<h2>Summary</h2><table>")
    parts += [f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in _summary_rows(run, s)]
    parts.append("</table>")
    if run.info.get("n_params"):
        parts.append(
            f"<p class='sub'>{run.info['n_params']:,} trainable parameters on {html.escape(str(run.info.get('device')))}. "
            "MFU = model FLOP/s / peak FLOP/s; model FLOPs = 6 &times; parameters &times; tokens "
            "(token-id models), or flops_per_sample &times; samples.</p>"
        )
    if any(run.steady("forward_s", r) is not None for r in run.ranks):
        parts.append("<h2>Step time by phase and rank</h2>" + _phase_table(run))
    for key, title, uri, _ in figures:
        parts.append(f"<h2>{html.escape(title)}</h2><div class='fig' id='fig-{key}'><img alt='{html.escape(title)}' src='{uri}'></div>")
    config = run.info.get("config")
    if isinstance(config, dict) and config:
        parts.append("<h2>Configuration</h2>" + _config_table(config))
    else:
        parts.append("<h2>Configuration</h2><p class='sub'>not recorded (metrics/run.json has no config: "
                     "a run from before it was recorded, or a recorder attached without one).</p>")
    if run.bad_lines:
        parts.append(f"<p class='sub'>{run.bad_lines} unreadable metrics line(s) skipped (a run cut short).</p>")
    if os.path.exists(os.path.join(run.run_dir, "timeline.json")):
        parts.append("<p class='sub'>Timeline: open timeline.json in ui.perfetto.dev or chrome://tracing.</p>")
    parts.append("</body></html>")
    return "\n".join(parts), [p for *_, p in figures if p]


def write_report(run_dir: str, out: str | None = None, png_dir: str | None = None) -> tuple[str, list[str]]:
    """Write ``out`` (default RUN_DIR/report.html) and PNGs (default RUN_DIR/report/); merge the timeline."""
    from ..metrics.timeline import merge

    run = load_run(run_dir)
    merge(run_dir)
    out = out or os.path.join(run_dir, "report.html")
    png_dir = png_dir or os.path.join(os.path.dirname(os.path.abspath(out)), "report")
    page, pngs = render_html(run, png_dir)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        f.write(page)
    return out, pngs


__all__ = ["render_html", "write_report"]
