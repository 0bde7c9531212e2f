"""GPU acceptance run (issue #13, "Correct on GPUs"): one command that the first
machine with a GPU runs once, and that CI runs on the CPU so that run is not
spent on bugs in this script.

    python -m benchmarks.gpu_acceptance --out DIR [--device cuda|cpu] [--only REGEX]
                                        [--budget-s 420] [--steps-scale X] [--jobs 1]

Steps (each a subprocess with its own timeout; a failure does not stop the
others; a step that cannot apply on this device is "skipped" with the reason):

* environment: versions, the GPU, the sync strategies on offer, and a one-rank
  gloo group with tensors on the device (what the multi-rank steps rely on).
* example/<gpt|resnet>/<fp32|bf16|fp16>: the unmodified example at world size 1
  (NCCL on cuda, gloo on cpu), checkpointed (blocking and asynchronous saves)
  and resumed, bitwise equal to an uninterrupted run (benchmarks/acceptance/resume.py).
* perf: bf16 against fp32 step time (CUDA events on a GPU), the step profiler
  on against off, peak memory (benchmarks/acceptance/perf.py).
* overhead: Slipstream at world size 1 against a plain PyTorch loop on the same
  torch.nn decoder, runs alternated: step times, identical losses, the user's
  max_memory_allocated after each run (benchmarks/acceptance/overhead.py).
* sync/<strategy> for every name in slipstream.sync.available(), and
  layout/<name> (FSDP2, ZeRO-2, TP, PP, 4-rank combinations, DiLoCo over FSDP2 replicas): 2 or 4 ranks
  through `slipstream run`, sharing one GPU with gloo + CUDA tensors
  (SLIPSTREAM_BACKEND=gloo SLIPSTREAM_DEVICE=cuda); every rank's model must
  end with the same bits (benchmarks/acceptance/ranks.py), and the ranks' mean
  losses and gradient norms must follow one process training the same model on
  the whole global batch (benchmarks/acceptance/reference.py, losses.py).
* conformance/*: issue #32's cases at 2 ranks (conformance_steps): bf16 parameters under
  every strategy, an asynchronous save on the final step then a resume followed by
  compressed steps, fp16 error feedback across a forced loss-scale change.
* binding/*: per-rank device binding (srun --gpus-per-task, a CUDA_VISIBLE_DEVICES per
  rank): a rank that sees one GPU must use it (benchmarks/acceptance/binding.py).
* nccl/2-ranks-1-gpu: NCCL with two ranks on one GPU, which Slipstream must
  refuse with a clear error (or, if it ever works, train correctly).

Ranks steps of one kind share a launch (starting processes costs more than
training these models); a configuration that fails ends its launch and the
configurations not yet started are launched again, so one failure costs the
others nothing but a restart.

--jobs N runs up to N one-process steps (the examples, perf) side by side, each
still with its own processes, folder and timeout; the ranks steps always run
alone. The default, 1, runs every step after the one before (what the GPU run
does: its timings are not shared with a neighbour). CI's CPU run uses 2: an
example is one process, and the second core would otherwise sit idle.

Every subprocess runs with Python's faulthandler on. Prints the plan's total
against --budget-s at the start, then a line per step (a failed one: its stack's
summary and the command that reruns just it); writes DIR/acceptance.json and
DIR/acceptance.md after every step (a killed run still leaves a report), with each
failed step's stack; exits 1 if any step failed. See docs/gpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.acceptance.plan import (  # noqa: F401 - re-exported: the kit's tests and callers read them here
    ESTIMATES, FAIL, LAYOUTS_2, LAYOUTS_4, PASS, SKIP_BLOCKED, SKIP_BUDGET, SKIP_DEVICE, SKIP_SELECTION, SKIPPED,
    Group, Sizes, Step, conformance_steps, layout_options, pipelined, sizes_for, sync_options,
)
from benchmarks.acceptance.failures import find_stack, first_failed_rank, rank_lines, rank_log_files, rerun_command
from benchmarks.acceptance.losses import brief_gap, reference_checks, reference_spec, tolerance_for
from benchmarks.acceptance.processes import clean_environ, command_text, read_json, stop_tree, tail
from benchmarks.acceptance.report import brief, markdown, source_commit

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BUDGET_S = 420.0
RANK_LOGS = "rank-logs"  # under a launch's folder: `slipstream run --log-dir`, one folder per rank

class Acceptance:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.started = time.monotonic()
        self.started_utc = datetime.datetime.now(datetime.timezone.utc)
        self.steps: list[Step] = []
        self.environment: dict = {}
        self.device = args.device
        self.only = re.compile(args.only) if args.only else None
        self.report_lock = threading.Lock()  # --jobs > 1: steps finish in several threads
        self.source = source_commit(ROOT)  # once: the source does not change under a run
        self.groups: list[Group] = []  # the ranks groups of the plan
        self.sizes: Sizes | None = None
        self.plan_total_s: float | None = None
        # One-rank references (benchmarks/acceptance/reference.py) by key, or why there are none.
        self.references: dict[str, dict] = {}  # key -> losses, grad_norms
        self.reference_problems: dict[str, str] = {}
        self.reference_runs: list[dict] = []

    # --- time ---------------------------------------------------------------
    def remaining_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def fits(self, step: Step) -> bool:
        if self.remaining_s() >= step.estimate_s:
            return True
        step.skip(SKIP_BUDGET, f"budget: {self.remaining_s():.0f} s left of --budget-s {self.args.budget_s:.0f}, "
                               f"step planned at {step.estimate_s:.0f} s")
        return False

    def timeout_for(self, planned_s: float) -> float:
        """Generous against the plan (first CUDA start-ups are slow), never past the budget."""
        return max(5.0, min(max(90.0, 4 * planned_s), self.remaining_s()))

    # --- processes ------------------------------------------------------------
    def run_process(self, cmd: list[str], env: dict[str, str], timeout_s: float, log: Path) -> tuple[int | None, float]:
        """Run ``cmd`` with its output in ``log``; (exit code or None on timeout, seconds)."""
        started = time.monotonic()
        with open(log, "w") as fh:
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**clean_environ(), **env}, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                stop_tree(proc)
                rc = None
        return rc, round(time.monotonic() - started, 2)

    def program_step(self, step: Step, module: str, args: list[str], env: dict[str, str], timeout_s: float) -> None:
        """A step that is one program writing a result JSON (environment, example, perf)."""
        folder = self.out / "steps" / step.name.replace("/", "__")
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        result_path = folder / "result.json"
        # --result first: an example step's args end with "-- EXAMPLE ARGS".
        cmd = [sys.executable, "-m", module, "--result", str(result_path), *args]
        step.commands.append(command_text(cmd, env))
        rc, step.seconds = self.run_process(cmd, env, timeout_s, folder / "output.log")
        result = read_json(result_path)
        step.checks = result.get("checks", []) if result else []
        step.figures = result.get("figures", {}) if result else {}
        if result and result.get("commands"):
            step.commands.extend(result["commands"])
        if result and result.get("environment"):
            self.environment = result["environment"]
        if rc is None:
            step.status, step.reason = FAIL, f"timed out after {timeout_s:.0f} s"
        elif result is None:
            step.status, step.reason = FAIL, f"exit code {rc} and no result file"
        else:
            step.status = PASS if result.get("status") == PASS and rc == 0 else FAIL
            if step.status == FAIL:
                failed = [c for c in step.checks if not c.get("ok")]
                step.reason = result.get("message") or (
                    f"{failed[0]['name']}: {failed[0].get('detail', '')}" if failed else f"exit code {rc}")
        if step.status == FAIL:
            step.output_tail = ((result or {}).get("output_tail") or "") + "\n--- step output ---\n" + tail(folder / "output.log")
            # The result's own traceback names the failing call; a run the step started keeps its
            # own log (failed_log); a crash of the step program itself is only in its output.
            result = result or {}
            failed_log = Path(result["failed_log"]) if result.get("failed_log") else None
            self.attach_stack(step, [(self.shown(result_path), result.get("traceback")),
                                     (self.shown(result_path), result.get("output_tail")),
                                     *([(self.shown(failed_log), tail(failed_log, 200_000))] if failed_log else []),
                                     (self.shown(folder / "output.log"), tail(folder / "output.log", 200_000))])

    def shown(self, path: Path) -> str:
        """A path as the report shows it: under the run's folder when it is there."""
        try:
            return str(path.relative_to(self.out))
        except ValueError:
            return str(path)

    def attach_stack(self, step: Step, candidates: list[tuple[str, str | None]]) -> None:
        """The first stack found in ``candidates`` ((where, text), most telling first) becomes the
        step's: the report shows its last lines, the console its one-line summary."""
        for source, text in candidates:
            found = find_stack(text or "")
            if found is not None:
                step.stack, step.stack_summary, step.stack_source = found.text, f"{found.kind}: {found.summary}", source
                return

    # --- the plan ---------------------------------------------------------------
    def run(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        env_step = Step("environment", ESTIMATES["cpu"]["environment"])
        self.steps.append(env_step)
        probe_args = ["--device", self.device] if self.device else []
        self.program_step(env_step, "benchmarks.acceptance.probe", probe_args, {}, self.timeout_for(30))
        self.report_progress(env_step)
        if not self.device:
            self.device = self.environment.get("device_chosen") or "cpu"
        units = self.plan(env_step)
        self.print_plan(env_step)

        def run_unit(unit_steps: list[Step], action: Any) -> None:
            if any(step.status == "pending" for step in unit_steps):
                action()
            with self.report_lock:
                for step in unit_steps:
                    if step.status == "pending":  # a group member the action left (should not happen)
                        step.status, step.reason = FAIL, "not run: internal error in the acceptance script"
                    self.report_progress(step)
                self.write_reports()

        # Consecutive one-process units form a batch that --jobs > 1 runs side by side, in order.
        batches: list[list[tuple[list[Step], Any, bool]]] = []
        for unit in units:
            if batches and unit[2] and batches[-1][-1][2]:
                batches[-1].append(unit)
            else:
                batches.append([unit])
        for batch in batches:
            if self.args.jobs > 1 and len(batch) > 1:
                with ThreadPoolExecutor(max_workers=self.args.jobs) as pool:
                    for future in [pool.submit(run_unit, unit_steps, action) for unit_steps, action, _ in batch]:
                        future.result()
            else:
                for unit_steps, action, _ in batch:
                    run_unit(unit_steps, action)
        self.write_reports()
        failed = [s for s in self.steps if s.status == FAIL]
        total = round(time.monotonic() - self.started, 1)
        print(f"acceptance: {len(self.steps) - len(failed)} of {len(self.steps)} steps passed or skipped, "
              f"{len(failed)} failed, {total} s; report: {self.out / 'acceptance.md'}", flush=True)
        return 1 if failed else 0

    def plan(self, env_step: Step) -> list[tuple[list[Step], Any, bool]]:
        """Every step after the environment step, in the order they run, as units (its steps, what
        runs them, whether it is one process that --jobs may run beside others); what this device
        cannot run and what --only leaves out are skipped here, before anything runs."""
        placement_ok = env_step.status == PASS
        sizes = sizes_for(self.device, self.args.steps_scale)
        est = ESTIMATES[self.device]
        env_step.estimate_s = est["environment"]
        self.sizes = sizes

        # A unit: its steps, what runs them, and whether it is one process (--jobs may run it beside others).
        def example(name: str, precision: str) -> tuple[list[Step], Any, bool]:
            step = Step(f"example/{name}/{precision}", est["example"])
            return [step], lambda: self.example_step(step, name, precision, sizes), True

        def ranks(nproc: int, backend: str, steps: list[Step], nccl_refusal: bool = False) -> tuple[list[Step], Any, bool]:
            group = Group(nproc, self.ranks_env(backend), steps, nccl_refusal=nccl_refusal)
            self.groups.append(group)
            return steps, lambda: self.ranks_group(group, sizes), False

        perf = Step("perf", est["perf"])
        overhead = Step("overhead", est["overhead"])
        binding = Step("binding/per-rank-gpu", est["binding"])
        if self.environment.get("sync_available"):
            syncs = [Step(f"sync/{s}", est["config2"], options=sync_options(s, sizes.ranks_steps))
                     for s in self.environment["sync_available"]]
        else:  # nothing to plan from: one line says so
            syncs = [Step("sync/*", 0)]
        layouts2 = [Step(f"layout/{n}", est["config2"], options=o) for n, o in LAYOUTS_2.items()]
        conformance = conformance_steps(self.environment.get("sync_available") or [], sizes.ranks_steps, est["config2"])
        layouts4 = [Step(f"layout/{n}", est["config4"], options=layout_options(o, sizes.ranks_steps))
                    for n, o in LAYOUTS_4.items()]
        # Most telling first, so a budget that runs out takes the least: each precision's
        # examples, then the profile figures, the NCCL refusal, the 2-rank matrix, the rest.
        units = [
            example("gpt", "fp32"), example("resnet", "fp32"),
            ([perf], lambda: self.perf_step(perf, sizes), True),
            ([overhead], lambda: self.overhead_step(overhead, sizes), True),
            ranks(2, "nccl", [Step("nccl/2-ranks-1-gpu", est["nccl"])], nccl_refusal=True),
            ([binding], lambda: self.binding_step(binding), True),
            ranks(2, "gloo", syncs + layouts2 + conformance),
            example("gpt", "bf16"), example("resnet", "bf16"), example("gpt", "fp16"), example("resnet", "fp16"),
            ranks(4, "gloo", layouts4),
        ]
        for unit_steps, _, _ in units:
            self.steps.extend(unit_steps)
        for step in self.steps[1:]:
            self.apply_device_and_selection(step, placement_ok, env_step)
        return units

    def planned_s(self) -> dict[str, float]:
        """Planned seconds of what is left to run, by part: each pending one-process step's
        estimate; per ranks group, a launch and its pending configurations; the loss references."""
        est = ESTIMATES[self.device]
        in_groups = {id(s) for g in self.groups for s in g.steps}
        parts: dict[str, float] = {}
        for step in self.steps[1:]:
            if step.status == "pending" and id(step) not in in_groups:
                kind = step.name.split("/", 1)[0]
                parts[kind] = parts.get(kind, 0.0) + step.estimate_s
        for group in self.groups:
            pending = [s for s in group.steps if s.status == "pending"]
            if pending:
                key = f"{group.nproc}-rank {group.env['SLIPSTREAM_BACKEND']}"
                parts[key] = est["launch"] + sum(s.estimate_s for s in pending)
        keys = self.reference_specs()
        if keys:
            parts["loss references"] = est["reference"] + est["reference_key"] * len(keys)
        return parts

    def print_plan(self, env_step: Step) -> None:
        """The plan's total at the start, against the budget: the kit must fit its window."""
        parts = self.planned_s()
        total = env_step.seconds + sum(parts.values())
        self.plan_total_s = round(total, 1)
        runs = sum(1 for s in self.steps[1:] if s.status == "pending")
        print(f"        plan: {runs} of {len(self.steps) - 1} steps to run on {self.device}, planned {total:.0f} s "
              f"with the environment step's {env_step.seconds:.0f} s, of --budget-s {self.args.budget_s:.0f} ("
              + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()) + ")", flush=True)
        if total > self.args.budget_s:
            print(f"        the plan exceeds the budget by {total - self.args.budget_s:.0f} s: the last steps "
                  "will be skipped (kind budget)", flush=True)

    def apply_device_and_selection(self, step: Step, placement_ok: bool, env_step: Step) -> None:
        if self.only and not self.only.search(step.name):
            step.skip(SKIP_SELECTION, f"not selected by --only {self.args.only!r}")
        elif step.name.startswith("nccl/") and self.device != "cuda":
            step.skip(SKIP_DEVICE, "device: NCCL needs CUDA, and this run is on the CPU (gloo steps cover the CPU)")
        elif not self.environment.get("device_usable") or step.name == "sync/*":
            step.skip(SKIP_BLOCKED, f"blocked: the environment step failed ({env_step.reason})")
        elif not placement_ok and (step.name.startswith(("sync/", "layout/"))):
            step.skip(SKIP_BLOCKED, f"blocked: a gloo group with {self.device} tensors did not start "
                                    f"in the environment step ({env_step.reason})")
        elif self.device == "cuda" and pipelined(step.name):
            # Ranks share the GPU over gloo here, and gloo's send/recv cannot carry GPU
            # memory (Slipstream refuses it): a GPU pipeline needs NCCL and a GPU per stage.
            step.skip(SKIP_DEVICE, "device: pp over gloo cannot carry CUDA tensors (send/recv), and one GPU "
                                   "cannot give NCCL a GPU per stage; the CPU run covers the pipeline layouts")

    # --- step kinds -----------------------------------------------------------------
    def example_step(self, step: Step, name: str, precision: str, sizes: Sizes) -> None:
        if not self.fits(step):
            return
        folder = self.out / "steps" / step.name.replace("/", "__")
        timeout = self.timeout_for(step.estimate_s)
        args = ["--example", name, "--precision", precision, "--device", self.device, "--every", str(sizes.every),
                "--out", str(folder / "runs"), "--run-timeout-s", str(max(30.0, timeout / 4)),
                *(["--no-fork"] if self.args.no_fork else []), "--", *sizes.example_args[name]]
        self.program_step(step, "benchmarks.acceptance.resume", args, {}, timeout)

    def perf_step(self, step: Step, sizes: Sizes) -> None:
        if not self.fits(step):
            return
        folder = self.out / "steps" / "perf"
        args = ["--device", self.device, "--out", str(folder / "runs"), *sizes.perf_args]
        self.program_step(step, "benchmarks.acceptance.perf", args, {}, self.timeout_for(step.estimate_s))

    def overhead_step(self, step: Step, sizes: Sizes) -> None:
        if not self.fits(step):
            return
        folder = self.out / "steps" / "overhead"
        args = ["--device", self.device, "--out", str(folder / "runs"), *sizes.overhead_args]
        self.program_step(step, "benchmarks.acceptance.overhead", args, {}, self.timeout_for(step.estimate_s))

    def binding_step(self, step: Step) -> None:
        if not self.fits(step):
            return
        env = {"CUDA_VISIBLE_DEVICES": self.environment["cuda_visible_devices"]} if (
            self.device == "cuda" and self.environment.get("cuda_visible_devices")) else {}
        self.program_step(step, "benchmarks.acceptance.binding", ["--device", self.device], env,
                          self.timeout_for(step.estimate_s))

    def ranks_env(self, backend: str) -> dict[str, str]:
        env = {"SLIPSTREAM_BACKEND": backend, "SLIPSTREAM_DEVICE": self.device,
               # A hang becomes an error (and a relaunch of the rest) after this long, not after 600 s.
               "SLIPSTREAM_COLLECTIVE_TIMEOUT_S": "60"}
        if self.device == "cuda":
            # Every rank on the first visible GPU: the point is ranks sharing one device.
            visible = (self.environment.get("cuda_visible_devices") or "0").split(",")[0].strip() or "0"
            env["CUDA_VISIBLE_DEVICES"] = visible
        return env

    def reference_specs(self) -> dict[str, dict]:
        """The loss references the pending ranks steps need and nobody has computed yet, by key:
        those of every group at once, so one process computes all of them (start-up costs more
        than training them)."""
        assert self.sizes is not None
        specs: dict[str, dict] = {}
        for group in self.groups:
            if group.nccl_refusal:
                continue
            for step in group.steps:
                if step.status == "pending":
                    spec = reference_spec(step.options, step.case, group.nproc, self.sizes.ranks_steps)
                    if spec["key"] not in self.references and spec["key"] not in self.reference_problems:
                        specs[spec["key"]] = spec
        return specs

    def ensure_references(self, group: Group) -> None:
        """Compute the missing loss references (one process, world size 1, the ranks' device)."""
        specs = self.reference_specs()
        if not specs:
            return
        assert self.sizes is not None
        est = ESTIMATES[self.device]
        folder = self.out / "steps" / "reference"
        run_dir = folder / f"run{len(self.reference_runs) + 1}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        plan = {"model": self.sizes.ranks_model, "steps": self.sizes.ranks_steps, "references": list(specs.values())}
        (run_dir / "plan.json").write_text(json.dumps(plan, indent=1))
        env = {k: v for k, v in group.env.items() if k == "CUDA_VISIBLE_DEVICES"}  # the ranks' GPU, nothing else
        cmd = [sys.executable, "-m", "benchmarks.acceptance.reference", "--device", self.device,
               "--plan", str(run_dir / "plan.json"), "--result", str(run_dir / "result.json")]
        timeout = self.timeout_for(est["reference"] + est["reference_key"] * len(specs))
        print(f"        computing {len(specs)} loss reference(s) at world size 1 ({self.device}), "
              f"up to {timeout:.0f} s ...", flush=True)
        rc, seconds = self.run_process(cmd, env, timeout, run_dir / "output.log")
        result = read_json(run_dir / "result.json") or {}
        found = result.get("figures", {}).get("references", {})
        for key in specs:
            if key in found and result.get("status") == PASS and rc == 0:
                self.references[key] = {"losses": found[key]["losses"], "grad_norms": found[key]["grad_norms"]}
            else:
                state = "timed out" if rc is None else f"exit code {rc}"
                why = result.get("message") or next((c["detail"] for c in result.get("checks", []) if not c["ok"]), "")
                self.reference_problems[key] = (f"the reference run failed ({state}{': ' + why if why else ''}; "
                                                f"{self.shown(run_dir / 'output.log')})")
        record = {"command": command_text(cmd, env), "seconds": seconds, "exit_code": rc,
                  "device": result.get("figures", {}).get("device"), "keys": sorted(specs)}
        if any(key in self.reference_problems for key in specs):
            probe = Step("reference", 0)
            self.attach_stack(probe, [(self.shown(run_dir / "result.json"), result.get("traceback")),
                                      (self.shown(run_dir / "output.log"), tail(run_dir / "output.log", 200_000))])
            record.update(message=result.get("message", ""), stack=probe.stack, stack_source=probe.stack_source)
        self.reference_runs.append(record)

    def ranks_group(self, group: Group, sizes: Sizes) -> None:
        """Launch the group's pending steps, again and again while a failure leaves some unstarted."""
        est = ESTIMATES[self.device]
        folder = self.out / "steps" / f"ranks{group.nproc}-{group.env['SLIPSTREAM_BACKEND']}"
        attempt = 0
        while True:
            todo = [s for s in group.steps if s.status == "pending"]
            if not todo:
                return
            # Keep what fits the budget, in order; the rest is skipped now.
            fitting, planned = [], est["launch"]
            missing = self.reference_specs() if not group.nccl_refusal else {}
            if missing:
                planned += est["reference"] + est["reference_key"] * len(missing)
            for step in todo:
                if planned + step.estimate_s <= self.remaining_s():
                    fitting.append(step)
                    planned += step.estimate_s
                else:
                    step.skip(SKIP_BUDGET, f"budget: {self.remaining_s():.0f} s left of --budget-s "
                                           f"{self.args.budget_s:.0f}, this launch planned at {planned + step.estimate_s:.0f} s")
            if not fitting:
                return
            if not group.nccl_refusal:
                self.ensure_references(group)
            attempt += 1
            launch_dir = folder / f"launch{attempt}"
            if launch_dir.exists():
                shutil.rmtree(launch_dir)
            launch_dir.mkdir(parents=True)
            plan = {"steps": sizes.ranks_steps, "model": sizes.ranks_model,
                    "configs": [{"name": s.name, "options": s.options, "case": s.case} for s in fitting]}
            (launch_dir / "plan.json").write_text(json.dumps(plan, indent=1))
            # Each rank's own log (--log-dir, --tee 3: also in the launch output, prefixed by rank):
            # the report shows the failing rank's stack, not an interleaving of every rank's.
            cmd = [sys.executable, "-m", "slipstream", "run", "-n", str(group.nproc),
                   "--log-dir", str(launch_dir / RANK_LOGS), "--tee", "3",
                   "-m", "benchmarks.acceptance.ranks", "--plan", str(launch_dir / "plan.json"), "--out", str(launch_dir)]
            timeout = self.timeout_for(planned)
            print(f"        launching {len(fitting)} configuration(s) on {group.nproc} ranks "
                  f"({group.env['SLIPSTREAM_BACKEND']}, {self.device}), up to {timeout:.0f} s ...", flush=True)
            rc, seconds = self.run_process(cmd, group.env, timeout, launch_dir / "output.log")
            launch_text = command_text(cmd, group.env)
            state = f"exit code {rc}" if rc is not None else f"timed out after {timeout:.0f} s"
            progressed = False
            for step in fitting:
                step.commands = [launch_text]
                step.figures["launch"] = f"{launch_dir.name}: {len(fitting)} configuration(s), {state}, {seconds} s"
                started = any(p.name.endswith(".started") for p in (launch_dir / step.name.replace("/", "__")).glob("*"))
                if group.nccl_refusal:
                    self.judge_nccl(step, group, launch_dir, rc)
                    step.seconds = max(step.seconds, seconds)  # a refusal has no per-configuration time
                elif started:
                    progressed = True
                    self.judge_ranks(step, group, launch_dir, rc)
                elif rc == 0:
                    step.status, step.reason = FAIL, "the launch succeeded but this configuration never started"
                # else: not started in a launch that failed: stays pending for the next launch
                if step.status == FAIL and not step.output_tail:
                    step.output_tail = tail(launch_dir / "output.log")
            if group.nccl_refusal:
                return
            if not progressed:  # the launch failed before any configuration: do not retry forever
                for step in fitting:
                    if step.status == "pending":
                        step.status, step.reason = FAIL, f"the launch failed before this configuration started ({state})"
                        step.output_tail = tail(launch_dir / "output.log")
                        self.attach_stack(step, self.rank_stack_candidates(launch_dir, group.nproc))
                return

    def rank_stack_candidates(self, launch_dir: Path, nproc: int, suspects: list[int] | None = None) -> list[tuple[str, str]]:
        """Where a launch's ranks left their stacks, the likeliest first: the rank `slipstream run`
        names as the first to fail, then ``suspects``, then the others; for each, its own log
        (--log-dir), else its lines of the launch's tee'd output; last, the launch output whole."""
        launch_text = tail(launch_dir / "output.log", 400_000)
        first = first_failed_rank(launch_text)
        order = [r for r in [first, *(suspects or []), *range(nproc)] if r is not None and 0 <= r < nproc]
        out: list[tuple[str, str]] = []
        for r in dict.fromkeys(order):
            files = rank_log_files(launch_dir / RANK_LOGS, r)
            out += [(f"rank {r}: {self.shown(f)}", tail(f, 200_000)) for f in files]
            if not files:
                out.append((f"rank {r}: its lines of {self.shown(launch_dir / 'output.log')}", rank_lines(launch_text, r)))
        out.append((self.shown(launch_dir / "output.log"), launch_text))
        return out

    def rank_records(self, step: Step, group: Group, launch_dir: Path) -> list[dict | None]:
        folder = launch_dir / step.name.replace("/", "__")
        return [read_json(folder / f"rank{r}.json") for r in range(group.nproc)]

    def judge_ranks(self, step: Step, group: Group, launch_dir: Path, rc: int | None) -> None:
        records = self.rank_records(step, group, launch_dir)
        missing = [r for r, rec in enumerate(records) if rec is None]
        errors = [(r, rec) for r, rec in enumerate(records) if rec is not None and rec.get("status") != "ok"]
        seconds = [rec.get("seconds", 0) for rec in records if rec]
        step.seconds = max(seconds) if seconds else 0.0
        if errors:
            r, rec = errors[0]
            step.status, step.reason = FAIL, f"rank {r}: {rec.get('message', 'error')}"
            step.output_tail = "--- launch output ---\n" + tail(launch_dir / "output.log")  # the traceback: step.stack
            folder = launch_dir / step.name.replace("/", "__")
            self.attach_stack(step, [(self.shown(folder / f"rank{e}.json"), rec_e.get("traceback"))
                                     for e, rec_e in errors] + self.rank_stack_candidates(launch_dir, group.nproc))
            return
        if missing:
            state = f"exit code {rc}" if rc is not None else "timed out"
            step.status, step.reason = FAIL, f"rank(s) {missing} never finished this configuration (launch {state})"
            # The configuration a rank never finished is the last it started: its launch ended
            # there, so the end of that rank's own log is this configuration's.
            self.attach_stack(step, self.rank_stack_candidates(launch_dir, group.nproc, missing))
            return
        checks = ranks_checks(records, group.env)
        if not group.nccl_refusal:  # the NCCL step is about its refusal; should it ever train, bits decide
            assert self.sizes is not None
            spec = reference_spec(step.options, step.case, group.nproc, self.sizes.ranks_steps)
            tolerance = tolerance_for(step.options, step.case, [r.get("sync_decision") for r in records])
            found, figures = reference_checks(records, self.references.get(spec["key"]), spec, tolerance,
                                              self.reference_problems.get(spec["key"], ""))
            checks += found
            step.figures["loss_reference"] = figures
            step.figures["loss_vs_reference"] = brief_gap(figures)
            step.commands += [r["command"] for r in self.reference_runs if spec["key"] in r["keys"]]
        step.checks = checks
        first = records[0]
        step.figures.update({
            "ranks": group.nproc, "layout": first.get("layout"),
            "backend": first["placement"]["backend"], "device": first["placement"]["device"],
            "model_digest": combined_digest(first["digests"])[:16],
            "final_loss_rank0": first["losses"][-1] if first.get("losses") else None,
        })
        failed = [c for c in checks if not c["ok"]]
        step.status = FAIL if failed else PASS
        if failed:
            step.reason = f"{failed[0]['name']}: {failed[0]['detail']}"

    def judge_nccl(self, step: Step, group: Group, launch_dir: Path, rc: int | None) -> None:
        """Two ranks, NCCL, one GPU: pass if refused with Slipstream's one-line error, or if it trained correctly."""
        records = self.rank_records(step, group, launch_dir)
        text = tail(launch_dir / "output.log", 20_000)
        # Slipstream's one-line error (a SlipstreamError in a worker) that is about GPUs/NCCL,
        # not just any error: a refusal for another reason would prove nothing here.
        refusal = [line for line in re.findall(r"slipstream: error[^\n]*", text) if re.search(r"GPU|NCCL", line, re.I)]
        if rc == 0 and all(rec and rec.get("status") == "ok" for rec in records):
            self.judge_ranks(step, group, launch_dir, rc)
            step.figures["outcome"] = "worked: NCCL ran two ranks on one GPU"
        elif rc is None:
            step.status, step.reason = FAIL, "hung: neither refused nor finished before the timeout"
        elif refusal:
            step.status = PASS
            step.figures["outcome"] = "refused as expected"
            step.figures["message"] = refusal[0][:400]
        else:
            step.status = FAIL
            step.reason = (f"exit code {rc}, and no Slipstream one-line error: two ranks on one GPU under NCCL "
                           "should either train correctly or be refused clearly (see the output)")
        if step.status == FAIL:
            step.output_tail = text[-4000:]

    # --- reporting ----------------------------------------------------------------
    def report_progress(self, step: Step) -> None:
        """The step's console line; a failed one gets a second line that points at its stack in
        acceptance.md and gives the command that reruns just this step."""
        if step.status == FAIL and not step.rerun:
            step.rerun = rerun_command(step.name, self.out, self.device or "cpu", self.args.steps_scale,
                                       self.args.no_fork)
        index = self.steps.index(step) + 1
        total = len(self.steps) if len(self.steps) > 1 else "?"  # the plan exists once the environment is known
        detail = step.reason if step.status != PASS else brief(step.figures)
        print(f"[{index:2d}/{total:>2}] {step.status:7s} {step.name:34s} {step.seconds:6.1f} s  {detail}"[:220],
              flush=True)
        if step.status == FAIL:
            found = step.stack_summary or "no stack: see its checks and output"
            print(f"        -> {found} [{self.out / 'acceptance.md'}, ### {step.name}]; rerun: {step.rerun}", flush=True)

    def write_reports(self) -> None:
        counts = {k: sum(1 for s in self.steps if s.status == k) for k in (PASS, FAIL, SKIPPED)}
        doc = {
            "title": "Slipstream GPU acceptance run",
            "started_utc": self.started_utc.isoformat(timespec="seconds"),
            "wall_s": round(time.monotonic() - self.started, 1),
            "device": self.device,
            "budget_s": self.args.budget_s,
            "steps_scale": self.args.steps_scale,
            "argv": sys.argv,
            "git": self.source,
            "environment": self.environment,
            "summary": counts,
            "plan_total_s": self.plan_total_s,
            "references": {"runs": self.reference_runs, "values": self.references, "problems": self.reference_problems},
            "steps": [s.to_json() for s in self.steps],
        }
        tmp = self.out / "acceptance.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1, default=str))
        os.replace(tmp, self.out / "acceptance.json")
        (self.out / "acceptance.md").write_text(markdown(doc))


def ranks_checks(records: list[dict], env: dict[str, str]) -> list[dict]:
    """Checks over every rank's record of one configuration (pure: JSON in, checks out)."""
    checks = []
    placements = {(r["placement"]["backend"], r["placement"]["device"].split(":")[0]) for r in records}
    wanted = (env["SLIPSTREAM_BACKEND"], env["SLIPSTREAM_DEVICE"])
    checks.append({"name": "every rank on the backend and device asked for", "ok": placements == {wanted},
                   "detail": f"asked {wanted}, got {sorted(placements)}"})
    names = set().union(*(r["digests"] for r in records))
    differing = sorted(n for n in names if len({r["digests"].get(n) for r in records}) > 1)
    # Zero tensors compared is no evidence: a rank that recorded no digests (an empty state
    # dict, a lost gather) must fail the check, not pass it vacuously.
    empty = [r for r, rec in enumerate(records) if not rec["digests"]]
    checks.append({"name": f"parameter digests equal on all {len(records)} ranks", "ok": not differing and not empty,
                   "detail": (f"rank(s) {empty} recorded zero tensors" if empty else
                              f"{len(names)} tensors" if not differing else f"differ: {', '.join(differing[:6])}")})
    tied = [r.get("tied_equal") for r in records]
    if any(t is not None for t in tied):
        checks.append({"name": "tied embedding and head weights equal", "ok": all(t is not False for t in tied),
                       "detail": str(tied)})
    checks.append({"name": "losses finite on every rank", "ok": all(r.get("losses_finite") for r in records),
                   "detail": str([r.get("losses", [])[-1:] for r in records])})
    if any("loss_gap" in r for r in records):
        gaps = [r.get("loss_gap", float("nan")) for r in records]
        bound = records[0].get("loss_gap_bound", 0.0)
        checks.append({"name": "losses after the forced scale change match the unforced run",
                       "ok": all(g <= bound for g in gaps),  # NaN compares False: fails
                       "detail": f"max |loss gap| per rank {gaps}, bound {bound}"})
    if any("resumed_from" in r for r in records):
        froms = {r.get("resumed_from") for r in records}
        checks.append({"name": "every rank resumed from the async save of the final step",
                       "ok": len(froms) == 1 and None not in froms, "detail": f"resumed from {sorted(map(str, froms))}"})
    return checks


def combined_digest(digests: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{k}={digests[k]};" for k in sorted(digests)).encode()).hexdigest()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_acceptance", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for acceptance.json, acceptance.md and every step's files")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda if torch sees a GPU, else cpu")
    p.add_argument("--only", default=None, metavar="REGEX",
                   help="run only steps whose name matches (re.search); the environment step always runs")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="wall-clock budget for the whole run; steps that no longer fit are skipped "
                        f"(default {DEFAULT_BUDGET_S:.0f}: 7 minutes, so the failed steps can be rerun in the same "
                        "short loan of a GPU)")
    p.add_argument("--steps-scale", type=float, default=1.0,
                   help="multiply every step's training steps (e.g. 0.5 on a slow CPU); each keeps a minimum")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run up to N one-process steps (examples, perf) side by side; ranks steps always run "
                        "alone (default 1: one step at a time, as on the GPU)")
    p.add_argument("--no-fork", action="store_true",
                   help="start every example run as a new python process (default: fork from a warm parent)")
    args = p.parse_args(argv)
    if args.budget_s <= 0 or not math.isfinite(args.budget_s):
        p.error(f"--budget-s must be > 0, got {args.budget_s}")
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.steps_scale <= 0:
        p.error(f"--steps-scale must be > 0, got {args.steps_scale}")
    if args.only:
        try:
            re.compile(args.only)
        except re.error as exc:
            p.error(f"--only must be a regular expression: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    faulthandler.enable()  # the orchestrator too: a crash here should also leave its stack
    return Acceptance(parse_args(argv)).run()


if __name__ == "__main__":
    raise SystemExit(main())
