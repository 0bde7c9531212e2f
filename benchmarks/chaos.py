"""Chaos harness: random faults against the GPT example, each trial checked bitwise against an uninterrupted run.

Every trial runs ``python -m slipstream run -n WORLD --max-restarts K`` on
examples/train_gpt.py (a small model, a checkpoint every few steps), injects
one or two faults at random steps (read from rank 0's step lines, or from a
``step_N.partial`` directory appearing), lets the job finish (relaunching the
same command where an orchestrator would), and compares every tensor of the
final state_dict with ``torch.equal`` against a reference run of the same
configuration (world size, synchronous or asynchronous saves) without faults.

Faults:
  worker_kill     SIGKILL a random rank's worker; the launcher restarts the group
  launcher_kill   SIGKILL the launcher, then relaunch the same command; workers
                  still alive 2 s after the kill are counted as orphans (and killed)
  sigterm         SIGTERM the launcher (preemption: emergency checkpoint, exit 143
                  expected), then relaunch
  kill_in_save    SIGKILL a random worker the moment a step_N.partial dir appears
  link_cut        (--link-cut, root) a 2-node emulated cluster; node 1's link is cut
                  for a few seconds

    python -m benchmarks.chaos --preset short            # CI: 2 ranks, 3 trials, < 75 s
    python -m benchmarks.chaos --preset full --trials 50 --worlds 2,4 --seed 1
    python -m benchmarks.chaos --preset full --trials 20 --worlds 2,4 --snapshot-every 1   # in-memory snapshots

Writes a JSON report (--out, default benchmarks/results/chaos.json) and prints a
table; exits 1 when any trial's final state is not bitwise equal to its reference
(or a trial failed: no fault injected, no final state, a timeout). Launcher exit
codes are as subprocess reports them: -9 is a launcher the harness SIGKILLed,
None one that ran past the trial's limit (its process tree is then killed).
"Fault -> next step" runs from the fault to the next step line rank 0 logged
(after a launcher fault: the relaunch's first step; for a link cut it includes
the cut). A failed trial's directory (console logs, checkpoints) is kept.

The short preset runs its 3 trials and the reference side by side (--jobs 4) to
stay under 75 s on 2 cores; the full preset runs one at a time so that its
recovery times are not inflated by trials competing for the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.chaos_faults import (FaultRecord, Launch, kill_in_save, launcher_kill, launcher_sigterm, link_cut,
                                     reap_orphans, workers, worker_kill)

REPO = Path(__file__).resolve().parents[1]
GPT = str(REPO / "examples" / "train_gpt.py")
KINDS = ("worker_kill", "launcher_kill", "sigterm", "kill_in_save")
RELAUNCHING = ("launcher_kill", "sigterm")


def log(msg: str) -> None:
    print(f"[chaos] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Workload:
    """The GPT example's size and schedule; one per harness run."""

    steps: int = 40
    every: int = 7
    dim: int = 64
    layers: int = 2
    context: int = 32
    batch_size: int = 8
    corpus_mb: float = 0.25
    max_restarts: int = 3
    snapshot_every: int | None = None
    """In-memory snapshots every this many steps (``--snapshot-every-steps``), trials and references alike."""

    def script_args(self, out: Path, ckpt: Path) -> list[str]:
        return [GPT, "--steps", str(self.steps), "--dim", str(self.dim), "--layers", str(self.layers),
                "--context", str(self.context), "--batch-size", str(self.batch_size), "--corpus-mb", str(self.corpus_mb),
                "--seed", "0", "--out", str(out), "--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", str(self.every)]


@dataclass(frozen=True)
class Setup:
    """What a reference run is shared by: a trial is compared with the reference of its setup."""

    world: int
    async_save: bool
    emulated: bool = False

    def label(self) -> str:
        return f"{self.world} ranks, {'async' if self.async_save else 'sync'} saves" + (", emulated 2x1" if self.emulated else "")


@dataclass
class Plan:
    setup: Setup
    faults: list[tuple[str, int]] = field(default_factory=list)
    seed: int = 0
    """Seeds the trial's own choices (which rank): trials that run side by side stay reproducible."""


def launcher_argv(setup: Setup, wl: Workload, run_dir: Path, out: Path, ckpt: Path) -> list[str]:
    argv = [sys.executable, "-m", "slipstream", "run"]
    argv += ["--emulate", "2x1"] if setup.emulated else ["-n", str(setup.world)]
    # --no-heal: the full restart is what these trials measure (healing in place is on by default
    # wherever it applies: tests/integration/test_heal_in_place.py checks that path).
    argv += ["--max-restarts", str(wl.max_restarts), "--no-heal", "--run-dir", str(run_dir), "--log-every-steps", "1",
             "--checkpoint-async" if setup.async_save else "--no-checkpoint-async"]
    if wl.snapshot_every is not None:
        argv += ["--snapshot-every-steps", str(wl.snapshot_every)]
    return argv + wl.script_args(out, ckpt)


def base_env(ns_prefix: str | None = None) -> dict[str, str]:
    env = {**os.environ, "SLIPSTREAM_PREEMPTION_DEADLINE_S": "10", "PYTHONUNBUFFERED": "1"}
    if ns_prefix:
        env["SLIPSTREAM_EMULATE_NS_PREFIX"] = ns_prefix
    return env


def compare_states(ref_path: Path, got_path: Path) -> dict:
    """torch.equal on every tensor of two saved state_dicts: equal, how many differ, max abs diff."""
    import torch

    a = torch.load(ref_path, map_location="cpu", weights_only=True)
    b = torch.load(got_path, map_location="cpu", weights_only=True)
    differ, max_diff = 0, 0.0
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b or a[key].shape != b[key].shape or a[key].dtype != b[key].dtype:
            differ += 1
            max_diff = float("inf")
            continue
        if not torch.equal(a[key], b[key]):
            differ += 1
            max_diff = max(max_diff, (a[key].double() - b[key].double()).abs().max().item())
    return {"bitwise_equal": differ == 0, "tensors": len(set(a) | set(b)), "tensors_differ": differ,
            "max_abs_diff": max_diff}


class Harness:
    def __init__(self, wl: Workload, tmp: Path, trial_timeout_s: float, cut_s: float) -> None:
        self.wl, self.tmp = wl, tmp
        self.trial_timeout_s, self.cut_s = trial_timeout_s, cut_s
        self.references: dict[Setup, dict] = {}
        self._ref_locks: dict[Setup, threading.Lock] = {}
        self._lock = threading.Lock()

    def reference(self, setup: Setup) -> dict:
        """The uninterrupted run of ``setup``: run once per harness run, then cached (one run even
        when several trials ask at once)."""
        with self._lock:
            lock = self._ref_locks.setdefault(setup, threading.Lock())
        with lock:
            if setup not in self.references:
                self.references[setup] = self._reference(setup)
            return self.references[setup]

    def _reference(self, setup: Setup) -> dict:
        d = self.tmp / f"reference-{setup.world}-{int(setup.async_save)}-{int(setup.emulated)}"
        d.mkdir(parents=True)
        prefix = f"chx{secrets.token_hex(2)}-" if setup.emulated else None
        started = time.monotonic()
        launch = Launch(launcher_argv(setup, self.wl, d / "run", d / "out", d / "ckpt"), d / "console.log",
                        base_env(prefix), str(REPO))
        code = launch.wait(self.trial_timeout_s)
        launch.close()
        model = d / "out" / "model.pt"
        ref = {"setup": setup.label(), "exit_code": code, "wall_s": round(time.monotonic() - started, 2),
               "path": str(model) if model.exists() else None, "log": str(d / "console.log")}
        if code is None:
            ref["reason"] = f"reference ran past {self.trial_timeout_s:.0f} s"
        elif code != 0 or not model.exists():
            ref["reason"] = f"reference exited {code}" + ("" if model.exists() else " without a final state")
        log(f"reference ({setup.label()}): exit {code}, {ref['wall_s']:.1f} s")
        return ref

    def trial(self, index: int, plan: Plan) -> dict:
        setup, wl = plan.setup, self.wl
        rng = random.Random(plan.seed)
        d = self.tmp / f"trial{index:03d}"
        d.mkdir(parents=True)
        out, ckpt = d / "out", d / "ckpt"
        prefix = f"chx{secrets.token_hex(2)}-" if setup.emulated else None
        runs = 0

        def start() -> Launch:
            nonlocal runs
            runs += 1
            return Launch(launcher_argv(setup, wl, d / f"run{runs}", out, ckpt), d / "console.log", base_env(prefix),
                          str(REPO))

        t0 = time.monotonic()
        deadline = t0 + self.trial_timeout_s
        launches = [start()]
        records: list[FaultRecord] = []
        exit_codes: list[int | None] = []
        reason = ""
        after_t = t0
        try:
            for kind, at_step in plan.faults:
                launch = launches[-1]
                rec = FaultRecord(kind, at_step)
                records.append(rec)
                if launch.wait_step(at_step, after_t, deadline) is None:
                    rec.note = f"the run ended before step {at_step}"
                    continue
                if kind == "kill_in_save":  # armed from this step on: strikes when the next save begins
                    kill_in_save(launch, rec, rng, setup.world, ckpt, t0, deadline)
                elif kind == "worker_kill":
                    worker_kill(launch, rec, rng, setup.world, t0)
                elif kind == "launcher_kill":
                    launcher_kill(launch, rec, t0)
                elif kind == "sigterm":
                    launcher_sigterm(launch, rec, t0, timeout_s=max(5.0, deadline - time.monotonic()))
                elif kind == "link_cut":
                    link_cut(launch, rec, prefix or "", 1, self.cut_s, t0)
                if rec.injected:
                    after_t = rec.t_mono
                if rec.injected and kind in RELAUNCHING:
                    exit_codes.append(rec.launcher_exit)
                    launches.append(start())  # what an orchestrator does: the same command again
            last = launches[-1]
            code = last.wait(deadline - time.monotonic())
            exit_codes.append(code)
            if code is None:
                reason = f"timed out: no exit within {self.trial_timeout_s:.0f} s of the trial's start (tree killed)"
            elif code != 0:
                reason = f"the last launcher exited {code}"
        finally:
            leftover = []
            for launch in launches:
                leftover += list(workers(launch.pid).values()) if launch.alive() else []
                launch.close()
            if leftover:
                reap_orphans(leftover, grace_s=0)
        wall = time.monotonic() - t0
        for rec in records:
            if rec.t_mono is not None:
                # After a launcher fault the next step that counts is the relaunch's: the step a
                # preempted launcher still logs while writing its emergency checkpoint is not recovery.
                later = [launch for launch in launches if launch.started > rec.t_mono] if rec.kind in RELAUNCHING else launches
                nexts = [t for t in (launch.first_step_after(rec.t_mono) for launch in later) if t is not None]
                rec.to_next_step_s = round(min(nexts) - rec.t_mono, 3) if nexts else None
                resumes = [r for r in (launch.first_resume_after(rec.t_mono) for launch in later) if r is not None]
                rec.resumed_from = min(resumes)[1] if resumes else None
                rec.at_s = round(rec.at_s, 3)
        row = {"index": index, "world": setup.world, "async_save": setup.async_save, "emulated": setup.emulated,
               "faults": [r.public() for r in records], "fault_injected": any(r.injected for r in records),
               "launcher_exit_codes": exit_codes, "relaunches": len(launches) - 1,
               "orphans_seen": sum(r.orphans for r in records), "wall_s": round(wall, 2), "log": str(d / "console.log")}
        model = out / "model.pt"
        row["final_state"] = str(model) if model.exists() else None
        ref = self.reference(setup)
        row.update(bitwise_equal=False, tensors_differ=None, max_abs_diff=None)
        if ref["path"] is None:
            reason = reason or f"no reference: {ref.get('reason')}"
        elif model.exists():
            row.update(compare_states(Path(ref["path"]), model))
        else:
            reason = reason or "no final state written"
        if not any(r.injected for r in records):
            reason = reason or "no fault was injected: " + "; ".join(r.note for r in records)
        row["failed"] = bool(reason) or not row["bitwise_equal"]
        if not reason and not row["bitwise_equal"]:
            reason = f"{row['tensors_differ']} of {row['tensors']} tensors differ (max abs diff {row['max_abs_diff']:.3g})"
        row["reason"] = reason
        return row


def plan_trials(preset: str, trials: int, worlds: list[int], rng: random.Random, wl: Workload, link_cut_on: bool) -> list[Plan]:
    """Which faults at which steps: fixed for the short preset, drawn from ``rng`` otherwise."""
    lo, hi = 3, max(4, wl.steps - wl.every - 3)
    if preset == "short":
        kinds = ["worker_kill", "launcher_kill", "sigterm"]
        return [Plan(Setup(worlds[0], False), [(k, rng.randint(lo, hi))], rng.getrandbits(32)) for k in kinds[:trials]]
    plans = []
    # The first fault's kind: every kind once per round of len(KINDS) trials, in random order
    # (random, yet a short run still sees each kind).
    firsts: list[str] = []
    for i in range(trials):
        if link_cut_on and i % 5 == 4:  # every fifth trial, when asked
            plans.append(Plan(Setup(2, rng.random() < 0.5, emulated=True), [("link_cut", rng.randint(lo, hi))],
                              rng.getrandbits(32)))
            continue
        setup = Setup(rng.choice(worlds), rng.random() < 0.5)
        first = rng.randint(lo, hi)
        if not firsts:
            firsts = rng.sample(KINDS, len(KINDS))
        faults = [(firsts.pop(), first)]
        if rng.random() < 0.3:  # some trials with two faults, the second later in the run
            faults.append((rng.choice(KINDS), rng.randint(min(first + 3, wl.steps - 3), wl.steps - 3)))
        plans.append(Plan(setup, faults, rng.getrandbits(32)))
    return plans


def summarize(rows: list[dict]) -> dict:
    by_kind: dict[str, int] = {}
    latencies: dict[str, list[float]] = {}
    for row in rows:
        for f in row["faults"]:
            if f["injected"]:
                by_kind[f["kind"]] = by_kind.get(f["kind"], 0) + 1
                if f["to_next_step_s"] is not None:
                    latencies.setdefault(f["kind"], []).append(f["to_next_step_s"])
    every = [x for xs in latencies.values() for x in xs]
    return {
        "trials": len(rows),
        "failed": sum(r["failed"] for r in rows),
        "bitwise_equal": sum(r["bitwise_equal"] for r in rows),
        "faults_injected": by_kind,
        "orphans_seen": sum(r["orphans_seen"] for r in rows),
        "fault_to_next_step_s": {
            "median": statistics.median(every) if every else None, "max": max(every) if every else None,
            "by_kind": {k: {"median": statistics.median(v), "max": max(v), "n": len(v)} for k, v in sorted(latencies.items())},
        },
    }


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def print_report(rows: list[dict], summary: dict, wall_s: float) -> None:
    print("| # | setup | faults (kind@step) | launcher exits | bitwise equal | orphans | fault -> next step | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        faults = ", ".join(
            f"{f['kind']}@{f['step']}" + (f" (resumed {f['resumed_from']})" if f["resumed_from"] is not None else "")
            if f["injected"] else f"{f['kind']} not injected" for f in r["faults"])
        nexts = ", ".join(fmt_s(f["to_next_step_s"]) for f in r["faults"] if f["injected"])
        equal = "yes" if r["bitwise_equal"] else f"NO ({r['reason']})"
        setup = f"{r['world']} ranks {'async' if r['async_save'] else 'sync'}" + (" emulated" if r["emulated"] else "")
        print(f"| {r['index']} | {setup} | {faults} | {r['launcher_exit_codes']} | {equal} | {r['orphans_seen']} | "
              f"{nexts or '-'} | {r['wall_s']:.1f} s |")
    lat = summary["fault_to_next_step_s"]
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(summary["faults_injected"].items())) or "none"
    print()
    print(f"trials: {summary['trials']} ({summary['failed']} failed)  |  faults injected: {kinds}")
    print(f"bitwise equal: {summary['bitwise_equal']}/{summary['trials']}  |  orphans seen: {summary['orphans_seen']}  |  "
          f"fault -> next step: median {fmt_s(lat['median'])}, max {fmt_s(lat['max'])}  |  wall {wall_s:.0f} s")
    for kind, v in lat["by_kind"].items():
        print(f"  {kind}: fault -> next step median {fmt_s(v['median'])}, max {fmt_s(v['max'])} (n={v['n']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=("short", "full"), default="full",
                   help="short: CI (2 ranks, 3 trials: worker kill, launcher kill + relaunch, SIGTERM); full: random faults")
    p.add_argument("--trials", type=int, default=None, help="number of trials (short: 3, full: 50)")
    p.add_argument("--worlds", default=None, help="comma-separated world sizes (short: 2, full: 2,4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the harness's own choices (faults, steps, ranks)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (short: 30, full: 48)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints (default 7)")
    p.add_argument("--trial-timeout-s", type=float, default=None, help="a trial's limit, relaunches included (short: 180, full: 300)")
    p.add_argument("--link-cut", action="store_true", help="also cut an emulated node's link (every fifth trial; root)")
    p.add_argument("--cut-s", type=float, default=3.0, help="how long a link cut lasts")
    p.add_argument("--jobs", type=int, default=None,
                   help="trials run side by side (short: 4, the reference included; full: 1, so that fault -> "
                        "next step times are not inflated by trials competing for the cores)")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "chaos.json"), help="JSON report")
    p.add_argument("--keep", action="store_true", help="keep the trials' directories (logs, checkpoints)")
    p.add_argument("--snapshot-every", type=int, default=None,
                   help="in-memory snapshots every N steps (slipstream run --snapshot-every-steps; default off)")
    args = p.parse_args(argv)

    short = args.preset == "short"
    trials = args.trials if args.trials is not None else (3 if short else 50)
    worlds = [int(w) for w in (args.worlds or ("2" if short else "2,4")).split(",")]
    if trials < 1 or any(w < 1 for w in worlds):
        p.error("--trials and every --worlds entry must be >= 1")
    if args.link_cut and os.geteuid() != 0:
        p.error("--link-cut needs root (network namespaces)")
    wl = Workload(steps=args.steps or (30 if short else 48), every=args.checkpoint_every or 7,
                  snapshot_every=args.snapshot_every)
    timeout_s = args.trial_timeout_s or (180.0 if short else 300.0)
    rng = random.Random(args.seed)
    plans = plan_trials(args.preset, trials, worlds, rng, wl, args.link_cut)

    tmp = Path(tempfile.mkdtemp(prefix="slipstream-chaos-"))
    started = time.monotonic()
    jobs = max(1, args.jobs or (4 if short else 1))
    harness = Harness(wl, tmp, timeout_s, args.cut_s)
    rows: list[dict] = []
    log(f"{len(plans)} trial(s), {wl.steps} steps, checkpoint every {wl.every}, seed {args.seed}, {jobs} at a time, "
        f"work dir {tmp}")

    def one(i: int, plan: Plan) -> dict:
        faults = " + ".join(f"{k}@{s}" for k, s in plan.faults)
        log(f"trial {i + 1}/{len(plans)} ({plan.setup.label()}): {faults}")
        try:
            row = harness.trial(i, plan)
        except Exception as e:  # a harness bug must not hide the other trials' results
            row = {"index": i, "world": plan.setup.world, "async_save": plan.setup.async_save,
                   "emulated": plan.setup.emulated, "faults": [], "fault_injected": False, "launcher_exit_codes": [],
                   "orphans_seen": 0, "wall_s": 0.0, "final_state": None, "bitwise_equal": False, "failed": True,
                   "reason": f"harness error: {type(e).__name__}: {e}"}
        status = "bitwise equal" if row["bitwise_equal"] else f"FAILED: {row['reason']}"
        nexts = ", ".join(fmt_s(f["to_next_step_s"]) for f in row["faults"] if f["injected"])
        log(f"trial {i + 1}: {status}; exits {row['launcher_exit_codes']}, orphans {row['orphans_seen']}, "
            f"fault -> next step {nexts or '-'}, {row['wall_s']:.1f} s")
        return row

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            # References first, so that with several jobs they run beside the first trials.
            for setup in dict.fromkeys(plan.setup for plan in plans):
                pool.submit(harness.reference, setup)
            futures = [pool.submit(one, i, plan) for i, plan in enumerate(plans)]
            rows = [f.result() for f in futures]
    finally:
        wall = time.monotonic() - started
        summary = summarize(rows)
        keep = args.keep or any(r["failed"] for r in rows)  # a failed trial's logs are the evidence
        report = {"preset": args.preset, "seed": args.seed, "worlds": worlds, "jobs": jobs, "workload": wl.__dict__,
                  "trial_timeout_s": timeout_s, "wall_s": round(wall, 1), "work_dir": str(tmp) if keep else None,
                  "summary": summary,
                  "references": {k.label(): v for k, v in harness.references.items()}, "trials": rows}
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, default=str) + "\n")
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print_report(rows, summary, wall)
    log(f"report: {out}" + (f"; trial directories kept in {tmp}" if keep else ""))
    return 0 if rows and all(r["bitwise_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
