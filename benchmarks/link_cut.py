"""A link cut mid-training on the emulated cluster: what the job does, how long it takes, what it loses.

Two emulated nodes (network namespaces, one rank each; root needed) train the
fault-injection worker (tests/integration/scripts_ft_train.py: deterministic
samples, a checkpoint every K steps). Once rank 0 has logged step S, node 1's
port leaves the switch for CUT seconds (``EmulatedCluster.cut_link``: its
packets vanish, no error reaches anyone), then comes back.

Two ways of running the job:

* ``fixed``: ``--nnodes 2``. The job cannot go on without node 1.
* ``elastic``: ``--nnodes 1:2``. Node 0 may go on alone and take node 1 back.

If the job as a whole fails, the benchmark relaunches it once, as an
orchestrator (a Kubernetes Job, a Slurm requeue) would, and the relaunch
resumes from the checkpoint directory.

Reported per mode: the exit codes, the world size of every step rank 0 ran,
steps redone, the time from the cut to the first step after it and to the end,
the hang report's first lines, and the final state against an uninterrupted
2-rank run: bitwise for ``fixed`` (same world size), to tolerance for ``elastic``
(steps at another world size add the same numbers in another order).

    sudo python -m benchmarks.link_cut                       # both modes, about 5 minutes
    sudo python -m benchmarks.link_cut --modes elastic --cut-s 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from slipstream.launch import LaunchOptions
from slipstream.launch.emulate import EmulatedCluster, missing_privileges
from slipstream.launch.proc import kill_tree

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "integration" / "scripts_ft_train.py")
RDZV_CONF = {"last_call_timeout": "2", "keep_alive_interval": "2", "keep_alive_max_attempt": "5"}


def worker_args(out: Path, ckpt: Path, steps: int, every: int, sleep_s: float) -> list[str]:
    return ["--out", str(out), "--ckpt", str(ckpt), "--every", str(every), "--steps", str(steps),
            "--dropout", "0", "--step-sleep-s", str(sleep_s)]


def step_log(out: Path) -> list[tuple[int, int]]:
    """(step, world size) of every step rank 0 ran, in order (a redone step appears again)."""
    path = out / "ids_rank0.log"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4:
            rows.append((int(parts[0]), int(parts[1])))
    return rows


def reference(work: Path, steps: int, every: int) -> dict:
    out = work / "reference"
    cmd = [sys.executable, "-m", "slipstream", "run", "-n", "2", WORKER,
           *worker_args(out, work / "reference_ckpt", steps, every, 0.0)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"link_cut: the uninterrupted reference run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return torch.load(out / "final.pt", weights_only=False)


def compare(ref: dict, got: dict) -> dict:
    a, b = ref["model"], got["model"]
    diffs = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}
    return {"bitwise_equal": all(torch.equal(a[k], b[k]) for k in a),
            "tensors_differing": sum(1 for d in diffs.values() if d > 0),
            "max_abs_diff": max(diffs.values())}


def launch_agents(cluster: EmulatedCluster, mode: str, args: list[str], timeout_s: float, log: Path,
                  collective_timeout_s: float) -> subprocess.Popen | int:
    base = LaunchOptions(WORKER, args, max_restarts=3, rdzv_id=f"cut-{mode}-{time.time_ns()}", rdzv_conf=dict(RDZV_CONF),
                         worker_env={"SLIPSTREAM_COLLECTIVE_TIMEOUT_S": str(collective_timeout_s),
                                     "SLIPSTREAM_RUN_DIR": str(log.parent / "run"),
                                     "SLIPSTREAM_PREEMPTION_DEADLINE_S": "3"})
    if mode == "fixed":
        return cluster.run(base, procs_per_node=1, timeout_s=timeout_s, log_path=str(log), cwd=str(REPO))
    # Elastic: the same agents with --nnodes 1:2 (EmulatedCluster.run starts --nnodes N).
    procs = []
    cores = len(os.sched_getaffinity(0))
    with open(log, "ab") as f:
        for node in range(2):
            argv = cluster.agent_argv(node, base, 1)
            argv[argv.index("--nnodes") + 1] = "1:2"
            env = cluster.node_env(node)
            env.update(base.worker_env)
            env.setdefault("OMP_NUM_THREADS", str(max(1, cores // 2)))
            procs.append(subprocess.Popen(cluster.exec_argv(node, argv), env=env, stdout=f, stderr=f,
                                          start_new_session=True, cwd=str(REPO)))
            if node == 0:
                time.sleep(2)  # node 0 hosts the rendezvous store
    deadline = time.monotonic() + timeout_s
    try:
        codes = []
        for p in procs:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        return max(codes, key=lambda c: c != 0)
    except subprocess.TimeoutExpired:
        return 1
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)


def one_mode(mode: str, work: Path, ref: dict, opts: argparse.Namespace) -> dict:
    out, ckpt = work / mode / "out", work / mode / "ckpt"
    out.mkdir(parents=True)
    args = worker_args(out, ckpt, opts.steps, opts.every, opts.step_sleep_s)
    log = work / mode / "agents.log"
    result: dict = {"mode": mode, "cut_s": opts.cut_s, "collective_timeout_s": opts.collective_timeout_s,
                    "rdzv_conf": RDZV_CONF, "launches": []}
    with EmulatedCluster(2, link="unshaped") as cluster:
        times: dict[str, float] = {}
        box: dict = {}

        def run_job() -> None:
            box["code"] = launch_agents(cluster, mode, args, opts.timeout_s, log, opts.collective_timeout_s)

        job = threading.Thread(target=run_job)
        started = time.monotonic()
        job.start()
        while len(step_log(out)) < opts.cut_at and job.is_alive():
            time.sleep(0.05)
        steps_before = len(step_log(out))
        cluster.cut_link(1)
        times["cut"] = time.monotonic()
        print(f"[{mode}] link of node 1 cut after {steps_before} steps", file=sys.stderr, flush=True)
        restored = False
        while job.is_alive():
            now = time.monotonic()
            if "first_step_after" not in times and len(step_log(out)) > steps_before:
                times["first_step_after"] = now
            if not restored and now - times["cut"] >= opts.cut_s:
                cluster.restore_link(1)
                restored, times["restore"] = True, now
                print(f"[{mode}] link restored", file=sys.stderr, flush=True)
            time.sleep(0.05)
        if not restored:
            cluster.restore_link(1)
        job.join()
        result["launches"].append({"exit": box.get("code"), "wall_s": round(time.monotonic() - started, 1)})
        if not (out / "final.pt").exists():
            # An orchestrator relaunches the failed job; it resumes from the checkpoint directory.
            print(f"[{mode}] job failed (exit {box.get('code')}); relaunching", file=sys.stderr, flush=True)
            box.clear()
            relaunched = time.monotonic()
            run_job()
            result["launches"].append({"exit": box.get("code"), "wall_s": round(time.monotonic() - relaunched, 1)})
        ended = time.monotonic()
    rows = step_log(out)
    worlds = [w for _, w in rows]
    result["worlds"] = [w for i, w in enumerate(worlds) if i == 0 or worlds[i - 1] != w]  # changes only
    result["steps_run"] = len(rows)
    result["steps_redone"] = len(rows) - len({s for s, _ in rows})
    if "first_step_after" in times:
        result["cut_to_next_step_s"] = round(times["first_step_after"] - times["cut"], 1)
    result["cut_to_end_s"] = round(ended - times["cut"], 1)
    hang = work / mode / "run" / "hang.txt"
    result["hang_report"] = hang.read_text().strip().splitlines()[:4] if hang.exists() else None
    if (out / "final.pt").exists():
        result["final"] = compare(ref, torch.load(out / "final.pt", weights_only=False))
    result["ok"] = result["launches"][-1]["exit"] == 0 and "final" in result and (
        result["final"]["bitwise_equal"] if mode == "fixed" else result["final"]["max_abs_diff"] < 1e-4)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="fixed,elastic", help="comma list of fixed, elastic")
    p.add_argument("--cut-s", type=float, default=30.0, help="how long node 1 stays partitioned")
    p.add_argument("--cut-at", type=int, default=12, help="cut once rank 0 has run this many steps")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=5, help="checkpoint interval (steps)")
    p.add_argument("--step-sleep-s", type=float, default=0.25)
    p.add_argument("--collective-timeout-s", type=float, default=10.0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per launch")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "link_cut.json"))
    p.add_argument("--keep", action="store_true", help="keep the work directory (agents' logs, checkpoints)")
    opts = p.parse_args(argv)
    missing = missing_privileges()
    if missing:
        print(f"link_cut: {missing}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"fixed", "elastic"}:
        print(f"link_cut: --modes takes fixed and/or elastic, got {opts.modes!r}", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="link_cut-") as tmp:
        work = Path(tempfile.mkdtemp(prefix="link_cut-")) if opts.keep else Path(tmp)
        if opts.keep:
            print(f"link_cut: work directory {work}", file=sys.stderr)
        ref = reference(work, opts.steps, opts.every)
        for mode in modes:
            results.append(one_mode(mode, work, ref, opts))
            print(json.dumps(results[-1], indent=1), flush=True)
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps({"command": "python -m benchmarks.link_cut " + " ".join(argv or sys.argv[1:]),
                                          "results": results}, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
