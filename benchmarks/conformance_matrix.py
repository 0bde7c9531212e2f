"""The conformance matrix (issue #32) as a benchmark preset: pairwise, full, or a sample.

Question it answers: does every configuration that TrainConfig and ``slipstream run``
accept train (finite loss, final loss within the documented bound of its reference),
and is every other one refused before any worker starts, with one line naming the
combination?

* ``--pairwise``: the covering array CI runs (tests/conformance/test_matrix.py);
* ``--full``: the whole cross product of the axes (tests/conformance/matrix.py);
* ``--sample N``: N rows of the full product's accepted rows, drawn with ``--seed``.

Refused rows are checked in-process (the pure check, no worker); accepted rows train
at 2 ranks on gloo, many rows per process group. Writes
``benchmarks/results/conformance-<mode>-<UTC>.json`` and a markdown table of
trained / refused / failed with the reason for every refusal and failure.

Example::

    PYTHONPATH=src:. python3 -m benchmarks.conformance_matrix --pairwise
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.conformance import matrix  # noqa: E402


def classify(rows: list[matrix.Row]) -> tuple[list[matrix.Row], dict[matrix.Row, str]]:
    accepted, refused = [], {}
    for row in rows:
        why = matrix.refusal(row)
        if why is None:
            accepted.append(row)
        else:
            refused[row] = why
    return accepted, refused


def markdown(mode: str, results: dict, refused: dict, wall_s: float, launches: int) -> str:
    counts = collections.Counter(v["status"] for v in results.values())
    lines = [f"# Conformance matrix ({mode})", "",
             f"{len(results) + len(refused)} rows: {counts['trained']} trained, {len(refused)} refused, "
             f"{counts['failed']} failed; {wall_s:.0f} s wall, {launches} launch(es) of 2 ranks (gloo).", ""]
    failed = {r: v for r, v in results.items() if v["status"] == "failed"}
    if failed:
        lines += ["## Failed", "", "| row | reason |", "|---|---|"]
        lines += [f"| {r.name} | {v['reason'].replace('|', '/')[:300]} |" for r, v in sorted(failed.items(), key=lambda kv: kv[0].name)]
        lines.append("")
    by_reason = collections.defaultdict(list)
    for row, why in refused.items():
        by_reason[why.split(": ", 1)[-1] if why.startswith("invalid training flag") else why].append(row)
    if refused:
        lines += ["## Refused (before any worker starts)", "", "| rows | reason |", "|---|---|"]
        lines += [f"| {len(rows)} | {why.replace('|', '/')} |" for why, rows in sorted(by_reason.items(), key=lambda kv: -len(kv[1]))]
        lines.append("")
    lines += ["## Trained", "", "| row | final loss | reference | s |", "|---|---|---|---|"]
    for r, v in sorted(results.items(), key=lambda kv: kv[0].name):
        if v["status"] == "trained":
            lines.append(f"| {r.name} | {v['losses'][-1]:.4f} | {v['reference'][-1]:.4f} | {v['seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--pairwise", action="store_true", help="the covering array CI runs")
    mode.add_argument("--full", action="store_true", help="the whole cross product")
    mode.add_argument("--sample", type=int, metavar="N", help="N accepted rows of the full product")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync", metavar="NAMES", default=None,
                   help="only rows of these sync strategies, comma-separated (e.g. diloco): a strategy added "
                        "after the last full run, recorded without rerunning the rest")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--launch-timeout-s", type=float, default=3 * 3600,
                   help="wall limit of one launch of 2 ranks (the full product is one launch unless a row breaks it)")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    if args.pairwise:
        name, rows = "pairwise", matrix.pairwise_rows()
    else:
        name, rows = ("full", list(matrix.all_rows())) if args.full else (f"sample{args.sample}", list(matrix.all_rows()))
    if args.sync:
        wanted = {n.strip() for n in args.sync.split(",") if n.strip()}
        known = {r.sync for r in rows}
        if not wanted <= known:
            p.error(f"--sync: unknown strategy {sorted(wanted - known)}; the matrix has {sorted(known)}")
        rows = [r for r in rows if r.sync in wanted]
        name = f"{name}-{'+'.join(sorted(wanted))}"
    accepted, refused = classify(rows)
    if args.sample:
        accepted = random.Random(args.seed).sample(accepted, min(args.sample, len(accepted)))
        refused = {}
    print(f"{len(rows)} rows: {len(accepted)} accepted, {len(refused)} refused ({time.perf_counter() - t0:.0f} s to classify)",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="conformance-") as work:
        results = matrix.run_rows(accepted, work, timeout_s=args.launch_timeout_s)
    launches = results.pop(None)["launches"]
    wall = time.perf_counter() - t0
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"mode": name, "utc": stamp, "wall_s": round(wall, 1), "launches": launches,
           "rows": [{**asdict(r), "status": v["status"], "reason": v["reason"], "losses": v.get("losses"),
                     "reference": v.get("reference"), "seconds": v.get("seconds")} for r, v in results.items()]
           + [{**asdict(r), "status": "refused", "reason": why} for r, why in refused.items()]}
    (out / f"conformance-{name}-{stamp}.json").write_text(json.dumps(doc, indent=1))
    md = markdown(name, results, refused, wall, launches)
    (out / f"conformance-{name}-{stamp}.md").write_text(md)
    print(md[:6000])
    print(f"written: {out}/conformance-{name}-{stamp}.json and .md")
    return 1 if any(v["status"] == "failed" for v in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
