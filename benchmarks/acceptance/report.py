"""The acceptance run's report: acceptance.md from the run's JSON document, and where the
source came from. No torch (see benchmarks/acceptance/plan.py).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.acceptance.failures import STACK_LINES
from benchmarks.acceptance.losses import TOLERANCES
from benchmarks.acceptance.plan import FAIL, PASS, SKIPPED

ROOT = Path(__file__).resolve().parents[2]


COMMIT_FILE = "COMMIT"
"""A file at the root of a copy made without .git that names the commit it was copied from
(`git -C CHECKOUT rev-parse HEAD > COPY/COMMIT`; docs/gpu.md, "The acceptance run")."""


def source_commit(root: Path = ROOT) -> dict:
    """The commit of the source this run executes, and where that was read:

    * ``git``: ``root`` is itself the top level of a git work tree (a checkout, or a worktree);
      ``dirty`` says whether tracked files differ from that commit;
    * ``COMMIT file``: ``root/COMMIT``, written beside the source when it was copied without .git;
    * ``unknown``: neither. A copy inside some other repository is *not* that repository's
      commit: the first GPU run reported the enclosing repository's commit as the project's.

    Example::

        source_commit(Path("/work/main"))   # {"commit": "379261e5...", "dirty": False, "source": "git"}
    """
    root = Path(root).resolve()
    # GIT_DIR and friends in the caller's environment would point git elsewhere than ``root``.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}

    def git(*args: str) -> tuple[int, str]:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, env=env)
        except (OSError, subprocess.SubprocessError):
            return 1, ""
        return done.returncode, done.stdout.strip()

    rc, top = git("rev-parse", "--show-toplevel")
    if rc == 0 and top and Path(top).resolve() == root:
        rc, head = git("rev-parse", "HEAD")
        if rc == 0 and head:
            _, status = git("status", "--porcelain", "--untracked-files=no")
            return {"commit": head, "dirty": bool(status), "source": "git"}
    written = root / COMMIT_FILE
    if written.is_file():
        found = re.match(r"\s*([0-9a-fA-F]{7,40})\b", written.read_text(errors="replace"))
        if found:
            return {"commit": found.group(1).lower(), "dirty": None, "source": f"{COMMIT_FILE} file"}
    return {"commit": "unknown", "dirty": None, "source": "unknown"}


def commit_line(git: dict) -> str:
    """The report's commit line (``git`` is :func:`source_commit`'s answer)."""
    commit = git.get("commit") or "unknown"
    if commit == "unknown":
        return (f"- commit unknown (the kit's root is not the top level of a git work tree and holds no "
                f"{COMMIT_FILE} file)")
    where = {"git": "git"}.get(git.get("source", ""), f"from the {COMMIT_FILE} file written with the source")
    dirty = " (with uncommitted changes)" if git.get("dirty") else ""
    return f"- commit {commit[:12]} ({where}){dirty}"


def brief(figures: dict) -> str:
    """The few figures worth a progress line."""
    keys = ("bitwise_equal", "final_loss", "bf16_speedup_vs_fp32", "bf16_speedup_vs_tf32", "profiler_overhead_pct",
            "peak_memory_mib", "overhead_pct", "max_memory_allocated_mib", "outcome", "layout", "final_loss_rank0",
            "loss_vs_reference", "device", "torch")
    return ", ".join(f"{k} {figures[k]}" for k in keys if k in figures)


def markdown(doc: dict) -> str:
    env = doc["environment"] or {}
    gpu = env.get("device_name") or "none"
    lines = [
        "# Slipstream GPU acceptance run",
        "",
        f"- device: **{doc['device']}** (GPU: {gpu}; torch {env.get('torch', '?')}, CUDA {env.get('cuda_runtime', '-')}, "
        f"NCCL {env.get('nccl', '-')}; {env.get('cpu_count', '?')} CPUs)",
        f"- started {doc['started_utc']}, wall {doc['wall_s']} s of a {doc['budget_s']:.0f} s budget "
        f"(planned {doc.get('plan_total_s')} s), steps scale {doc['steps_scale']}",
        commit_line(doc["git"]),
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
    lines += overhead_section(doc)
    lines += references_section(doc)
    failures = [s for s in doc["steps"] if s["status"] == FAIL]
    if failures:
        lines += ["", "## Failures", "",
                  "Each failed step: why, the command that reruns just that step (from the checkout's root), "
                  f"the last lines of the failing process's stack (at most {STACK_LINES}; a native crash shows "
                  "faulthandler's header and the crashing thread's innermost frames), then the end of its output.", ""]
        for s in failures:
            lines += failure_section(s)
    return "\n".join(lines) + "\n"


def overhead_section(doc: dict) -> list[str]:
    """Slipstream's own cost at world size 1 (benchmarks/acceptance/overhead.py), per run."""
    step = next((s for s in doc["steps"] if s["name"] == "overhead" and s["figures"].get("runs")), None)
    if step is None:
        return []
    f = step["figures"]
    m = f["model"]
    lines = ["", "## Slipstream's overhead (world size 1)", "",
             f"A decoder-only transformer from torch.nn ({m['parameters_m']}M parameters, d {m['dim']}, {m['layers']} "
             f"layers, sequence {m['seq']}, batch {m['batch']}, vocabulary {m['vocab']}), {m['precision']}, "
             f"{m['optimizer']}; {m['steps']} timed steps after {m['warmup']} per run, runs alternating; timing: "
             f"{f['timing']}. Memory: `torch.cuda.max_memory_allocated()` in the user's process after each run, "
             "its peak reset before each run.", "",
             "| run | step ms (median) | final loss | loss rel gap vs plain | max_memory_allocated MiB |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['kind']} | {r['step_ms_median']} | {r['final_loss']} | {r['loss_max_rel_gap_vs_first_plain']} | "
              f"{r['max_memory_allocated_mib'] if r['max_memory_allocated_mib'] is not None else 'n/a'} |" for r in f["runs"]]
    lines += ["", f"- Slipstream over plain PyTorch: **{f['overhead_pct']}%** per step (median "
                  f"{f['step_ms_median']['slipstream']} against {f['step_ms_median']['plain']} ms; a figure, not a "
                  "criterion)"]
    if f.get("peak_memory_reset_suspected"):
        lines.append("- **the Slipstream runs read a far lower peak than the plain ones: something reset the process's "
                     "CUDA peak-memory statistics during them**")
    return lines


def references_section(doc: dict) -> list[str]:
    """The loss references and the tolerance of each kind of configuration."""
    refs = doc.get("references") or {}
    if not refs.get("runs"):
        return []
    lines = ["", "## One-rank references", "",
             "Each 2- and 4-rank configuration against one process training the same model from the same weights "
             "on all its data-parallel ranks' rows at once (a plain PyTorch loop, the same device), computed once "
             "per precision, parameter dtype, data-parallel size and steps: the ranks' mean loss at every step, "
             "and the global gradient norm Slipstream measured at its log steps. The norm is there because AdamW "
             "hides a gradient scaled by a constant (a sum where a mean was meant) from the losses. A step fails "
             "outside its kind's bound.", "",
             "| kind | bound | why |", "|---|---|---|"]
    lines += [f"| {t.kind} | {t.describe()} | {md_cell(t.why, limit=None)} |" for t in TOLERANCES.values()]
    lines += ["", "| reference | losses | gradient norms |", "|---|---|---|"]
    lines += [f"| {k} | {v['losses']} | {v['grad_norms']} |" for k, v in refs.get("values", {}).items()]
    lines += [f"| {k} | **none**: {md_cell(v)} | |" for k, v in refs.get("problems", {}).items()]
    for run in refs["runs"]:
        lines += ["", f"- {len(run['keys'])} reference(s) in {run['seconds']} s on {run.get('device')}: `{run['command']}`"]
        if run.get("stack"):
            lines += ["", f"Stack, from {run['stack_source']}:", "", "```", run["stack"].strip(), "```"]
    return lines


def md_cell(text: Any, limit: int | None = 300) -> str:
    """``text`` as one table cell: pipes escaped, one line, cut at ``limit`` characters."""
    return str(text).replace("|", "\\|").replace("\n", " ")[:limit]


def failure_section(step: dict) -> list[str]:
    """One failed step of acceptance.md: reason, rerun command, the step's command, its stack."""
    command = step["command"] if isinstance(step["command"], str) else (step["command"] or [""])[0]
    out = [f"### {step['name']}", "", step["reason"], "", f"- rerun: `{step.get('rerun', '')}`",
           f"- command: `{command}`"]
    if step.get("stack"):
        out += [f"- {step['stack_summary']}", "", f"Stack, from {step['stack_source']}:", "", "```",
                step["stack"].strip(), "```"]
    else:
        out += ["- no Python traceback or faulthandler block in the step's results and logs"
                + (": a check failed (above)" if any(not c.get("ok") for c in step.get("checks", [])) else "")]
    output = step.get("output_tail", "").strip()
    if output:
        out += ["", "End of the output:", "", "```", output[-1500:], "```"]
    return out + [""]
