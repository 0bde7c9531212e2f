"""Does ``--sync auto`` ever lose to plain all-reduce? Short and long jobs, side by side (issue #35).

Question it answers: what ``auto``'s start (link probe, observed step, decision,
verification) costs a short job, against ``--sync allreduce`` on the same
emulated cluster, and whether ``auto`` keeps its gain where compression pays.

Each model is a plain torchrun-style DDP MLP (the script below, run by
``slipstream run --emulate 2x1 --link RATE --sync NAME``: the script's DDP model
is adopted, docs/zero-change.md), learning a fixed random teacher:

* ``small``: width 256, depth 2 (0.09M parameters, 0.34 MB of gradients), 32 samples a step;
* ``small_compute``: the same model, 4096 samples a step (compute-bound: little to gain);
* ``large``: width 1024, depth 4 (3.2M parameters, 12.9 MB of gradients).

``allreduce`` and ``auto`` run interleaved (A B, then B A) over ``--repeats``.
Reported per model and strategy: end-to-end wall time (the whole ``slipstream
run``), the training time (DDP's construction, where ``auto`` probes, plus the
loop), the final training loss (mean of the last 10 steps) and a held-out test
loss, and ``auto``'s plan; ratios are auto over allreduce, per repeat pair and
median. The first steps' times show where ``auto``'s start goes.

Needs root (namespaces, tc). Example::

    sudo PYTHONPATH=src python3 -m benchmarks.auto_short --repeats 2

Writes ``benchmarks/results/auto-short-<UTC>.json`` and prints a markdown table.
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

# name -> (width, depth, steps, batch per rank): steps sized for ~15 s of training loop on
# this machine's 200 Mbit/s emulated link for the small models (the short job).
# small: communication is most of the step (its 14 ms all-reduce against ~3 ms of compute);
# small_compute: the same model on 4096 samples a step, where compute is ~90 % of the step and
# compression has little to gain.
MODELS = {"small": (256, 2, 800, 32), "small_compute": (256, 2, 100, 4096), "large": (1024, 4, 40, 32)}
STRATEGIES = ("allreduce", "auto")


def worker(args: argparse.Namespace) -> None:
    """The training script (one rank): a torchrun DDP loop, timed step by step."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    def mlp(width: int, depth: int) -> nn.Sequential:
        layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 10))

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    teacher = mlp(64, 2)
    net = mlp(args.width, args.depth)
    import torch._dynamo  # noqa: F401  DDP's constructor imports it (2-3 s here, loaded): not in build_s
    dist.barrier()  # the ranks' start skew out of the figure: build_s is DDP's and the strategy's own
    t0 = time.perf_counter()
    model = DDP(net)  # under slipstream run --sync NAME, the strategy is applied here (auto probes)
    t_build = time.perf_counter() - t0
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(10_000)
    x_test = torch.randn(2048, 64, generator=g)
    with torch.no_grad():
        y_test = teacher(x_test).argmax(dim=1)
    losses, step_s = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        t = time.perf_counter()
        gen = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(args.batch, 64, generator=gen)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        step_s.append(time.perf_counter() - t)
    loop_s = time.perf_counter() - start
    with torch.no_grad():
        test_loss = F.cross_entropy(model.module(x_test), y_test).item()
    if rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "result.json").write_text(json.dumps({
            "build_s": t_build, "loop_s": loop_s, "train_s": t_build + loop_s, "test_loss": test_loss,
            "final_loss": statistics.fmean(losses[-10:]), "step_s": step_s,
            "params": sum(p.numel() for p in net.parameters())}))
    dist.barrier()
    dist.destroy_process_group()


def run_once(model: str, strategy: str, link: str, work: Path, timeout_s: float) -> dict:
    width, depth, steps, batch = MODELS[model]
    out, run_dir = work / "out", work / "run"
    cmd = [sys.executable, "-m", "slipstream", "run", "--emulate", "2x1", "--link", link, "--run-dir", str(run_dir),
           "--sync", strategy, str(Path(__file__).resolve()), "--worker", "--width", str(width), "--depth", str(depth),
           "--steps", str(steps), "--batch", str(batch), "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    row = {"wall_s": wall, **json.loads((out / "result.json").read_text())}
    metrics = run_dir / "metrics" / "rank0.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        if records:
            last = records[-1]
            row["decision"] = last.get("sync_decision")
            row["reason"] = last.get("sync_decision_reason")
            row["verification"] = last.get("sync_verification")
            row["link"] = last.get("sync_link")
    return row


START_STEPS = 16  # auto's probe, observed step, decision and verification (up to 12 steps) fall in these


def start_extra_s(row: dict) -> float:
    """What a run's start cost beyond its steady state: DDP's construction (where ``auto``
    probes) plus its first START_STEPS steps, less as many steps at the median of the rest."""
    steps = row["step_s"]
    return row["build_s"] + sum(steps[:START_STEPS]) - START_STEPS * statistics.median(steps[START_STEPS:])


def _ratio(rows: dict[str, list[dict]], key: str) -> list[float]:
    return [a[key] / b[key] for a, b in zip(rows["auto"], rows["allreduce"])]


def table(rows: dict[str, dict[str, list[dict]]]) -> str:
    """The markdown table: per model, auto over allreduce (median, then each repeat pair)."""
    lines = ["| model | auto x allreduce: wall (each repeat) | train (each) | test loss (each) | final loss | "
             "auto's start extra over allreduce's, s (share of allreduce's train) | auto's plans |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        cells = []
        for key in ("wall_s", "train_s", "test_loss", "final_loss"):
            ratios = _ratio(r, key)
            cells.append(f"{statistics.median(ratios):.3f} ({', '.join(f'{v:.3f}' for v in ratios)})")
        extra = [(start_extra_s(a) - start_extra_s(b), b["train_s"]) for a, b in zip(r["auto"], r["allreduce"])]
        cells.append(", ".join(f"{e:+.2f} ({e / t:+.1%})" for e, t in extra))
        plans = "; ".join(str(x.get("decision")) for x in r["auto"])
        params = r["auto"][0]["params"] / 1e6
        lines.append(f"| {name} ({params:.2f}M) | " + " | ".join(cells) + f" | {plans} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="200mbit")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    # the worker's own options (slipstream run starts this file with --worker)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--depth", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=100, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=32, help=argparse.SUPPRESS)
    p.add_argument("--report", metavar="JSON", help="print the table of a saved run again, and exit")
    args = p.parse_args(argv)
    if args.report:
        print(table(json.loads(Path(args.report).read_text())["rows"]))
        return 0
    if args.worker:
        worker(args)
        return 0
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    load = [os.getloadavg()[0]]
    rows: dict[str, dict[str, list[dict]]] = {n: {s: [] for s in STRATEGIES} for n in names}
    with tempfile.TemporaryDirectory(prefix="auto-short-") as tmp:
        for name in names:
            for repeat in range(args.repeats):
                order = STRATEGIES if repeat % 2 == 0 else tuple(reversed(STRATEGIES))
                for strategy in order:
                    row = run_once(name, strategy, args.link, Path(tmp, f"{name}-{strategy}-{repeat}"), args.timeout_s)
                    rows[name][strategy].append(row)
                    first = ", ".join(f"{s * 1e3:.0f}" for s in row["step_s"][:8])
                    print(f"{name} {strategy} #{repeat + 1}: wall {row['wall_s']:.1f} s, train {row['train_s']:.2f} s "
                          f"(DDP built in {row['build_s']:.2f} s), loss {row['final_loss']:.4f}, test "
                          f"{row['test_loss']:.4f}; first steps ms: {first}; median step "
                          f"{statistics.median(row['step_s']) * 1e3:.1f} ms"
                          + (f"; {row.get('decision')}; {row.get('verification')}" if strategy == "auto" else ""),
                          flush=True)
    load.append(os.getloadavg()[0])
    text = table(rows) + f"\n\nload average (1 min) at start and end: {load[0]:.2f}, {load[1]:.2f}"
    print(text)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out, f"auto-short-{stamp}.json")
    path.write_text(json.dumps({"link": args.link, "repeats": args.repeats, "load": load, "rows": rows,
                                "table": text}, indent=1))
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
