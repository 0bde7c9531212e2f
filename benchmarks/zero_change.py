"""Zero-change acceleration (issue #33): unmodified scripts, plain against ``--sync auto``, on an emulated cluster.

Question it answers: what does ``slipstream run --sync auto`` give a script that was
never written for Slipstream (a torchrun DDP loop, a Hugging Face Trainer script)
when its nodes are joined by a slow link, and what does it cost in loss?

Each script runs through ``slipstream run --emulate 2x1 --link RATE`` (two network
namespaces, one rank each, tbf-shaped veth: docs/cluster.md), once without a
training option (the script as under torchrun: nothing is installed) and once
with ``--sync auto``, interleaved A B / B A over ``--repeats`` so a noisy
neighbour hurts both alike. Reported per script and mode: end-to-end wall time
(the whole ``slipstream run``: start, rendezvous, training, exit), the training
loop's own time and final loss (from the script's ``--out DIR/result.json``), and
for ``auto`` how many steps it observed before deciding: what a restart costs
again, since the decision and the error-feedback residuals are not in the
script's own checkpoints (docs/zero-change.md).

Needs root (namespaces, tc). Example::

    sudo PYTHONPATH=src python3 -m benchmarks.zero_change --link 200mbit --repeats 2

Writes ``benchmarks/results/zero-change-<UTC>.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPTS = {
    "ddp_torchrun": ["examples/ddp_torchrun.py", "--steps", "60", "--width", "1024", "--depth", "3"],
    "hf_trainer": ["examples/hf_trainer.py", "--steps", "40"],
}
MODES = {"plain": [], "auto": ["--sync", "auto"]}


def run_once(script: list[str], mode: str, link: str, work: Path, timeout_s: float) -> dict:
    out, run_dir = work / "out", work / "run"
    cmd = [sys.executable, "-m", "slipstream", "run", "--emulate", "2x1", "--link", link, "--run-dir", str(run_dir),
           *MODES[mode], *script, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    # ddp_torchrun.py writes final_loss; hf_trainer.py its last logged loss (the mean over ranks)
    row = {"wall_s": wall, "final_loss": result.get("final_loss", result.get("loss")), "train_s": result.get("train_s")}
    metrics = run_dir / "metrics" / "rank0.jsonl"
    if mode == "auto" and metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        decided = next((r for r in records if "observing" not in str(r.get("sync_decision"))), None)
        row["decision"] = records[-1].get("sync_decision")
        row["decided_by_step"] = decided["step"] if decided else None
        row["step_time_s"] = [r.get("step_time_s") for r in records]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="200mbit")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--scripts", default=",".join(SCRIPTS), help=f"comma-separated, of {', '.join(SCRIPTS)}")
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = p.parse_args(argv)
    names = [n for n in args.scripts.split(",") if n]
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        p.error(f"unknown script(s) {', '.join(unknown)}; known: {', '.join(SCRIPTS)}")
    rows: dict[str, dict[str, list[dict]]] = {n: {m: [] for m in MODES} for n in names}
    with tempfile.TemporaryDirectory(prefix="zero-change-") as tmp:
        for name in names:
            for repeat in range(args.repeats):
                order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
                for mode in order:
                    work = Path(tmp, f"{name}-{mode}-{repeat}")
                    row = run_once(SCRIPTS[name], mode, args.link, work, args.timeout_s)
                    rows[name][mode].append(row)
                    print(f"{name} {mode} #{repeat + 1}: {row['wall_s']:.1f} s wall, loss {row['final_loss']:.4f}"
                          + (f", {row.get('decision')}" if mode == "auto" else ""), flush=True)
    lines = [f"| script | mode | end-to-end s (median of {args.repeats}) | train loop s | final loss | auto's decision |",
             "|---|---|---:|---:|---:|---|"]
    for name in names:
        base = statistics.median(r["wall_s"] for r in rows[name]["plain"])
        for mode in MODES:
            rs = rows[name][mode]
            wall = statistics.median(r["wall_s"] for r in rs)
            train = [r["train_s"] for r in rs if r.get("train_s") is not None]
            train_text = f"{statistics.median(train):.1f}" if train else "-"
            loss = statistics.median(r["final_loss"] for r in rs)
            decision = "-" if mode != "auto" else f"{rs[-1].get('decision')} (by step {rs[-1].get('decided_by_step')})"
            lines.append(f"| {name} | {mode} | {wall:.1f} ({base / wall:.2f}x) | {train_text} | {loss:.4f} | {decision} |")
    table = "\n".join(lines)
    print(table)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out, f"zero-change-{stamp}.json")
    path.write_text(json.dumps({"link": args.link, "repeats": args.repeats, "rows": rows, "table": table}, indent=1))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
