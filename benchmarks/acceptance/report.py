"""The acceptance run's report: acceptance.md from the run's JSON document, and where the
source came from. No torch (see benchmarks/acceptance/plan.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from benchmarks.acceptance.plan import FAIL, PASS, SKIPPED

ROOT = Path(__file__).resolve().parents[2]


def git_state() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def brief(figures: dict) -> str:
    """The few figures worth a progress line."""
    keys = ("bitwise_equal", "final_loss", "bf16_speedup_vs_fp32", "bf16_speedup_vs_tf32", "profiler_overhead_pct",
            "peak_memory_mib", "outcome", "layout", "final_loss_rank0", "device", "torch")
    return ", ".join(f"{k} {figures[k]}" for k in keys if k in figures)


def markdown(doc: dict) -> str:
    env = doc["environment"] or {}
    gpu = env.get("device_name") or "none"
    lines = [
        "# Slipstream GPU acceptance run",
        "",
        f"- device: **{doc['device']}** (GPU: {gpu}; torch {env.get('torch', '?')}, CUDA {env.get('cuda_runtime', '-')}, "
        f"NCCL {env.get('nccl', '-')}; {env.get('cpu_count', '?')} CPUs)",
        f"- started {doc['started_utc']}, wall {doc['wall_s']} s of a {doc['budget_s']:.0f} s budget, "
        f"steps scale {doc['steps_scale']}",
        f"- commit {doc['git'].get('commit', '?')[:12]}{' (with uncommitted changes)' if doc['git'].get('dirty') else ''}",
        f"- result: {doc['summary'][PASS]} passed, {doc['summary'][FAIL]} failed, {doc['summary'][SKIPPED]} skipped",
        f"- command: `{' '.join(['python -m benchmarks.gpu_acceptance', *doc['argv'][1:]])}`",
        "",
        "| step | status | s | figures or reason |",
        "|---|---|---:|---|",
    ]
    for s in doc["steps"]:
        text = s["reason"] if s["status"] != PASS else brief(s["figures"])
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {md_cell(text)} |")
    perf = next((s for s in doc["steps"] if s["name"] == "perf" and s["status"] == PASS), None)
    if perf:
        f = perf["figures"]
        lines += ["", "## Performance (world size 1)", "",
                  f"Model {f.get('model')}; timing: {f.get('timing')}; medians of every timed step.", "",
                  "| configuration | step ms (median) |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in f.get("step_ms_median", {}).items()]
        lines += ["", f"- bf16 speed-up over fp32: **{f.get('bf16_speedup_vs_fp32')}x**"
                  + (f"; over fp32 with TF32 matmuls: **{f['bf16_speedup_vs_tf32']}x**" if "bf16_speedup_vs_tf32" in f else "")
                  + " (vendors claim 1.5-2x)",
                  f"- profiler on vs off, overhead %: {f.get('profiler_overhead_pct')}",
                  f"- peak memory MiB ({f.get('peak_memory_source')}): {f.get('peak_memory_mib')}"]
    failures = [s for s in doc["steps"] if s["status"] == FAIL]
    if failures:
        lines += ["", "## Failures", ""]
        for s in failures:
            command = s["command"] if isinstance(s["command"], str) else (s["command"] or [""])[0]
            lines += [f"### {s['name']}", "", s["reason"], "", f"command: `{command}`", "", "```",
                      s.get("output_tail", "").strip()[-3000:], "```", ""]
    return "\n".join(lines) + "\n"


def md_cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")[:300]
