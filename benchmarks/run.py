"""The side-by-side benchmark suite: one command, JSON + BENCHMARKS.md table + PNG plots.

    python -m benchmarks.run --quick          # <= 10 min on 2 cores (needs root for the cluster)
    python -m benchmarks.run --full           # every workload x link x topology x system (hours)
    python -m benchmarks.run --report-only benchmarks/results/latest.json   # tables and plots again

What it runs:

* collectives (benchmarks/collectives.py): all-reduce (flat and hierarchical),
  reduce-scatter, all-gather over a size sweep, algbw/busbw against the link;
* training (benchmarks/train_worker.py): each workload x topology x link, every
  system in one job so that systems alternate within the same minutes
  (floor, DDP with tuned bucket, DDP + bf16 hook, DDP + PowerSGD, DeepSpeed
  ZeRO 0/2, Slipstream strategies), medians of ``--repeats`` runs;
* codec cost (benchmarks/codec_cost.py), once per workload, before its training
  jobs and never beside them: floor step, backward time, and each codec's
  one-core compute and wire bytes, stored in ``results["codec_cost"][workload]``;
  the report's machine limit (x limit column) is computed from it.

Topologies NxP with N > 1 run in an emulated cluster (one network namespace
per node, tbf-shaped links; slipstream.launch.emulate) and need root. 1xP runs
P local processes (no namespace, no shaping, no root) so the suite is usable
without root too.

When a job fails (a system crashed), its systems are retried one job each, so
one broken system costs its own figures only; the error is recorded in the
JSON and shown in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

BASELINES = ["floor", "ddp", "ddp_bf16", "ddp_powersgd", "deepspeed_z0", "deepspeed_z2"]
# Systems run only when named: torch's own all-reduce hook (what any comm hook costs over DDP).
DIAGNOSTICS = ["ddp_hook_allreduce"]


def slipstream_systems(names: list[str] | None = None) -> list[str]:
    """``slipstream:NAME`` for each strategy (all of ``slipstream.sync.available()`` by default)."""
    from slipstream import sync

    available = sync.available()
    chosen = available if names is None else [n for n in names if n in available]
    return [f"slipstream:{n}" for n in chosen]


PRESETS = {
    "quick": {
        "collectives": [{"topology": "2x2", "link": "1gbit", "max_bytes": "16M", "iters": 5}],
        "workloads": ["mlp"],
        "topologies": ["2x1"],
        "links": ["1gbit", "200mbit"],
        "slipstream": ["bf16", "powersgd", "auto"],
        "repeats": 3,
        "steps": 10,
        "warmup": 2,
        "bucket_sweep": "5,25",
    },
    "full": {
        "collectives": [
            {"topology": t, "link": l, "max_bytes": "256M", "iters": 5}
            for t in ("2x1", "2x2") for l in ("unshaped", "1gbit", "200mbit")
        ],
        "workloads": ["mlp", "gpt", "resnet"],
        "topologies": ["2x1", "2x2"],
        "links": ["unshaped", "5gbit", "1gbit", "200mbit"],
        "slipstream": None,  # all strategies
        "repeats": 3,
        "steps": 30,
        "warmup": 3,
        "bucket_sweep": "1,5,25,100",
    },
}


def parse_topology(text: str) -> tuple[int, int]:
    from slipstream.launch.emulate import parse_shape

    return parse_shape(text)


class Runner:
    """Runs one benchmark job on a topology; keeps one emulated cluster per topology."""

    def __init__(self, out_dir: Path, verbose: bool = False) -> None:
        self.out_dir = out_dir
        self.verbose = verbose
        self.clusters: dict[int, object] = {}
        self.log_path = out_dir / "jobs.log"

    def cluster(self, nodes: int, link: str):
        from slipstream.launch.emulate import EmulatedCluster

        if nodes not in self.clusters:
            self.clusters[nodes] = EmulatedCluster(nodes, link=link).up()
        c = self.clusters[nodes]
        c.set_link(link)
        return c

    def close(self) -> None:
        for c in self.clusters.values():
            c.down()
        self.clusters.clear()

    def job(self, module: str, args: list[str], topology: str, link: str, timeout_s: float) -> tuple[int, str]:
        """Run ``python -m module args`` on every rank; (exit code, tail of its log)."""
        from slipstream.launch import LaunchOptions

        nodes, procs = parse_topology(topology)
        with open(self.log_path, "a") as fh:
            fh.write(f"\n=== {datetime.datetime.now(datetime.timezone.utc).isoformat()} {topology} {link} "
                     f"{module} {shlex.join(args)}\n")
        start = self.log_path.stat().st_size
        env_extra = {"LOGLEVEL": "WARNING", "TORCH_CPP_LOG_LEVEL": "ERROR"}
        if nodes == 1:
            if link not in ("unshaped", None):
                raise SystemExit(f"topology {topology} runs without a cluster, so its link must be unshaped, not {link}")
            cmd = [sys.executable, "-m", "slipstream", "run", "-n", str(procs), "-m", module, *args]
            with open(self.log_path, "ab") as log:
                try:
                    code = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=log, timeout=timeout_s,
                                          env={**os.environ, **env_extra}).returncode
                except subprocess.TimeoutExpired:
                    code = 124
        else:
            cluster = self.cluster(nodes, link)
            opts = LaunchOptions(module, args, module=True, worker_env=env_extra)
            code = cluster.run(opts, procs, timeout_s=timeout_s, failure_grace_s=20, log_path=str(self.log_path),
                               cwd=str(ROOT))
        with open(self.log_path, "rb") as fh:
            fh.seek(start)
            tail = fh.read().decode(errors="replace")
        return code, _error_summary(tail)


def _error_summary(log: str) -> str:
    lines = [l for l in log.splitlines() if l.strip() and "hostname of the client socket" not in l]
    errs = [l for l in lines if "Error" in l or "error" in l or "Exception" in l]
    return (errs[-1] if errs else (lines[-1] if lines else "no output")).strip()[:400]


def run_collectives(runner: Runner, spec: dict, out: Path) -> dict:
    path = out / f"collectives_{spec['topology']}_{spec['link']}.json"
    args = ["--max-bytes", spec["max_bytes"], "--iters", str(spec["iters"]), "--out", str(path)]
    t0 = time.monotonic()
    code, err = runner.job("benchmarks.collectives", args, spec["topology"], spec["link"], timeout_s=1200)
    if code != 0 or not path.exists():
        return {"kind": "collectives", "topology": spec["topology"], "link": spec["link"], "error": err}
    doc = json.loads(path.read_text())
    doc.update(topology=spec["topology"], link=spec["link"], wall_s=time.monotonic() - t0)
    return doc


def run_codec_cost(workload: str, world_sizes: list[int], out: Path, repeats: int = 20,
                   timeout_s: float = 900) -> dict:
    """``benchmarks.codec_cost`` for one workload in a process of its own (one thread, no job beside it).

    Its figures (see ``codec_cost.measure``), or ``{"error": ...}`` when it failed.
    """
    path = out / f"codec_cost_{workload}.json"
    cmd = [sys.executable, "-m", "benchmarks.codec_cost", "--workload", workload, "--codecs", "all",
           "--repeats", str(repeats), "--world-sizes", ",".join(str(n) for n in sorted(set(world_sizes))),
           "--json", str(path)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0 or not path.exists():
        return {"error": _error_summary(proc.stdout + proc.stderr)}
    return json.loads(path.read_text())


def run_training(runner: Runner, workload: str, topology: str, link: str, systems: list[str],
                 preset: dict, out: Path) -> dict:
    """One job with every system; on failure, one job per system to isolate the broken one."""

    def job(names: list[str], tag: str) -> tuple[dict | None, str]:
        path = out / f"train_{workload}_{topology}_{link}_{tag}.json"
        args = ["--workload", workload, "--systems", ",".join(names), "--repeats", str(preset["repeats"]),
                "--steps", str(preset["steps"]), "--warmup", str(preset["warmup"]),
                "--bucket-sweep", preset["bucket_sweep"],
                "--slipstream-bucket", preset.get("slipstream_bucket", "tuned"), "--out", str(path)]
        code, err = runner.job("benchmarks.train_worker", args, topology, link, timeout_s=3600)
        if code == 0 and path.exists():
            return json.loads(path.read_text()), ""
        return None, err

    t0 = time.monotonic()
    doc, err = job(systems, "all")
    errors: dict[str, str] = {}
    if doc is None:
        print(f"  job failed ({err}); retrying system by system", file=sys.stderr)
        merged: dict | None = None
        for name in systems:
            part, perr = job(["floor", name] if name != "floor" else ["floor"], name.replace(":", "-"))
            if part is None:
                errors[name] = perr
                continue
            if merged is None:
                merged = part
            else:
                merged["runs"].extend(r for r in part["runs"] if r["system"] == name)
        doc = merged or {"kind": "train", "workload": workload, "runs": []}
    doc.update(topology=topology, link=link, errors=errors, wall_s=time.monotonic() - t0)
    return doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="the <= 10 minute subset (default)")
    mode.add_argument("--full", action="store_true", help="everything (hours on 2 cores)")
    mode.add_argument("--report-only", metavar="JSON[,JSON]",
                      help="only regenerate tables/plots (and BENCHMARKS.md) from results files")
    p.add_argument("--workloads", help="comma list (mlp,gpt,resnet)")
    p.add_argument("--topologies", help="comma list of NODESxPROCS (1xP runs locally, without root)")
    p.add_argument("--links", help="comma list of links (unshaped,5gbit,1gbit,200mbit; "
                   "with a round trip and loss: 100mbit,40ms,0.1%%)")
    p.add_argument("--systems", help="comma list; default: baselines + the preset's Slipstream strategies")
    p.add_argument("--slipstream", help="comma list of Slipstream strategies to add (or 'all')")
    p.add_argument("--repeats", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--collectives", metavar="TOPO@LINK[:MAXBYTES],...",
                   help="collective runs instead of the preset's, e.g. 2x2@1gbit:64M")
    p.add_argument("--bucket-sweep", help="DDP bucket sizes (MiB) to tune over, e.g. 5,25 (one value: no tuning)")
    p.add_argument("--slipstream-bucket", choices=("tuned", "default"),
                   help="DDP bucket of the slipstream:* systems: the DDP peers' tuned one (default), or Slipstream's default")
    p.add_argument("--no-collectives", action="store_true")
    p.add_argument("--no-training", action="store_true")
    p.add_argument("--codec-cost-repeats", type=int, default=20,
                   help="timed runs per codec of the once-per-workload codec cost (the machine limit); 0: skip it")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results/<UTC time>)")
    p.add_argument("--no-markdown", action="store_true", help="do not rewrite BENCHMARKS.md")
    args = p.parse_args(argv)

    from benchmarks import report
    from slipstream.errors import UsageError
    from slipstream.launch.emulate import parse_link, split_link_list

    if args.report_only:
        # Several results files (comma-separated) share the generated section, in the order given.
        report.render_many([Path(p) for p in args.report_only.split(",") if p], update_markdown=not args.no_markdown)
        return 0

    preset = dict(PRESETS["full" if args.full else "quick"])
    preset_name = "full" if args.full else "quick"
    if args.collectives:
        preset["collectives"] = [_collective_spec(c) for c in split_link_list(args.collectives)]
    if args.bucket_sweep:
        preset["bucket_sweep"] = args.bucket_sweep
    if args.slipstream_bucket:
        preset["slipstream_bucket"] = args.slipstream_bucket
    for key in ("repeats", "steps"):
        if getattr(args, key) is not None:
            preset[key] = getattr(args, key)
    workloads = args.workloads.split(",") if args.workloads else preset["workloads"]
    topologies = args.topologies.split(",") if args.topologies else preset["topologies"]
    links = split_link_list(args.links) if args.links else preset["links"]
    for link in links:
        try:
            parse_link(link)
        except UsageError as exc:
            p.error(f"--links: {exc}")
    if args.systems:
        systems = args.systems.split(",")
        known = BASELINES + DIAGNOSTICS + slipstream_systems()
        unknown = [s for s in systems if s not in known]
        if unknown:
            p.error(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(known)}")
    else:
        ss = None if args.slipstream == "all" else (args.slipstream.split(",") if args.slipstream else preset["slipstream"])
        systems = BASELINES + slipstream_systems(ss)
    if "floor" not in systems:
        systems = ["floor", *systems]

    needs_root = any(parse_topology(t)[0] > 1 for t in topologies) or (
        not args.no_collectives and any(parse_topology(c["topology"])[0] > 1 for c in preset["collectives"]))
    if needs_root:
        from slipstream.launch.emulate import missing_privileges

        why = missing_privileges()
        if why:
            print(f"benchmarks.run: the emulated cluster cannot be built here: {why}.\n"
                  f"  Run as root, or use --topologies 1x2 --links unshaped --no-collectives (local, unshaped).",
                  file=sys.stderr)
            return 2

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) if args.out else RESULTS / stamp
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "meta": {
            "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
            "preset": preset_name,
            "started_utc": stamp,
            "host": platform.node(),
            "cores": len(os.sched_getaffinity(0)),
            "load_avg_start": os.getloadavg(),
            "python": platform.python_version(),
            "git_commit": _git_commit(),
            "repeats": preset["repeats"],
            "steps": preset["steps"],
            "warmup_steps": preset["warmup"],
        },
        "collectives": [],
        "codec_cost": {},
        "train": [],
    }
    try:
        import torch

        results["meta"]["torch"] = torch.__version__
    except ImportError:
        pass
    runner = Runner(out)
    t_start = time.monotonic()
    # SIGTERM must reach the finally below, or the clusters' namespaces outlive us.
    signal.signal(signal.SIGTERM, _terminate)
    try:
        if not args.no_collectives:
            for spec in preset["collectives"]:
                print(f"collectives {spec['topology']} @ {spec['link']} ...", file=sys.stderr, flush=True)
                results["collectives"].append(run_collectives(runner, spec, out))
                _save(results, out)
        if not args.no_training:
            for workload in workloads:
                sizes = [parse_topology(t)[0] * parse_topology(t)[1] for t in topologies]
                if args.codec_cost_repeats > 0:
                    print(f"codec cost {workload} (n = {', '.join(map(str, sorted(set(sizes))))}) ...",
                          file=sys.stderr, flush=True)
                    results["codec_cost"][workload] = run_codec_cost(workload, sizes, out, args.codec_cost_repeats)
                    _save(results, out)
                for topology in topologies:
                    for link in links:
                        if parse_topology(topology)[0] == 1 and link != "unshaped":
                            continue
                        print(f"training {workload} {topology} @ {link}: {', '.join(systems)} ...",
                              file=sys.stderr, flush=True)
                        doc = run_training(runner, workload, topology, link, systems, preset, out)
                        results["train"].append(doc)
                        _save(results, out)
    finally:
        runner.close()
    results["meta"]["wall_s"] = time.monotonic() - t_start
    results["meta"]["load_avg_end"] = os.getloadavg()
    _save(results, out)
    report.render(results, out, update_markdown=not args.no_markdown)
    print(f"results: {out / 'results.json'} ({results['meta']['wall_s']:.0f} s)", file=sys.stderr)
    return 0


def _git_commit() -> str | None:
    """The commit measured (strategies change under the suite's feet); '+dirty' when edited."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _collective_spec(text: str) -> dict:
    """``"2x2@1gbit:64M"`` -> {"topology": "2x2", "link": "1gbit", "max_bytes": "64M", "iters": 5}."""
    topo, _, rest = text.partition("@")
    link, _, max_bytes = rest.partition(":")
    parse_topology(topo)
    return {"topology": topo, "link": link or "unshaped", "max_bytes": max_bytes or "16M", "iters": 5}


def _save(results: dict, out: Path) -> None:
    path = out / "results.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
