"""Acceptance step "example/<name>/<precision>": an example trains at world size 1,
is interrupted and resumed from its checkpoints, and ends bitwise equal to an
uninterrupted run.

    python -m benchmarks.acceptance.resume --example gpt --precision bf16 --device cuda \\
        --out DIR --result r.json --every 2 -- --batch-size 4 --layers 2

Four runs of the unmodified example (N = 3k steps, k = --every):

=============  ==============================================================  ===========
run            what                                                            must equal
=============  ==============================================================  ===========
reference      N steps, no checkpoints                                         -
sync_saves     N steps, a blocking save every k steps                          reference
resume_k       resumes from sync_saves' step k, saves asynchronously           reference
resume_2k      resumes from resume_k's step 2k (written by the async writer)   reference
=============  ==============================================================  ===========

"Interrupted at step k" is made exact by copying only the checkpoints up to k
into a fresh directory: that is what a run killed right after step k's commit
leaves behind, without racing a signal against a run that lasts a second. The
examples cannot simply be run with a shorter --steps: the GPT's learning-rate
schedule depends on --steps, so a shorter run would train differently.

Every run uses deterministic kernels (common.make_deterministic: strict mode;
if the reference run finds an op without a deterministic version, warn-only
mode for all four); the reference vs sync_saves pair shows whether two
uninterrupted runs agree at all.

Runs are forked from this process after torch and Slipstream are imported
(they cost seconds per process on a busy machine; a fork costs milliseconds).
This process never initialises CUDA, so each child starts CUDA afresh; --no-fork
runs each as a new ``python`` process instead.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks.acceptance.common import ROOT, compare_states, make_deterministic, write_result

EXAMPLES = {"gpt": "examples/train_gpt.py", "resnet": "examples/train_resnet.py"}
# strict | warn: how a run's child calls torch.use_deterministic_algorithms (common.make_deterministic).
DETERMINISM_ENV = "ACCEPTANCE_DETERMINISM"
# What torch raises in strict mode for an op without a deterministic version.
NO_DETERMINISTIC_OP = re.compile(r"does not have a deterministic implementation")
# What a child says when CUDA was initialised in the parent before the fork.
CUDA_FORK_ERROR = re.compile(r"re-initialize CUDA in forked subprocess|CUDA driver initialization failed|"
                             r"initialization error|cudaErrorInitializationError")


@dataclass
class Run:
    name: str
    rc: int | None = None
    seconds: float = 0.0
    timed_out: bool = False
    log: Path | None = None
    command: str = ""

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    def tail(self, chars: int = 2500) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log and self.log.exists() else ""


def exec_example(argv: list[str]) -> None:
    """Run ``SCRIPT ARGS`` as ``python SCRIPT ARGS`` would, with deterministic kernels.
    Never returns: the example ends the process itself (slipstream.shutdown)."""
    from slipstream.errors import SlipstreamError
    from slipstream.launch.worker import run_as_main

    code = 0
    try:
        make_deterministic(strict=os.environ.get(DETERMINISM_ENV, "strict") == "strict")
        print(f"acceptance: {thread_settings()}", flush=True)
        run_as_main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except SlipstreamError as exc:
        print(f"slipstream: error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except BaseException:  # noqa: BLE001 - a forked child must never return into the parent's code
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def thread_settings() -> str:
    """This process's intra-op threading, one line: on a CPU, LayerNorm's backward sums its
    weight and bias gradients in per-thread partial sums, so two runs with different thread
    counts differ in the last bits (measured at the GPT example's kit sizes: 1 vs 2 threads,
    up to 7.5e-6 in attn.k.bias after 3 steps). Printed by every run, compared when two differ."""
    import torch

    env = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_DYNAMIC", "MKL_DYNAMIC")
                   if k in os.environ)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"threads {torch.get_num_threads()} interop {torch.get_num_interop_threads()} cpus {cpus} env [{env}]"


def _settings_seen(run: Run) -> str:
    found = re.findall(r"^acceptance: (threads .*)$", run.tail(100_000), re.M)
    return found[0] if found else "not printed"


def _wait(pid: int, deadline: float) -> tuple[int | None, bool]:
    """(exit code, timed out) of a forked child, killing it at the deadline."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), False
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, True
        time.sleep(0.05)


def run_example(run: Run, argv: list[str], env: dict[str, str], timeout_s: float, fork: bool) -> Run:
    shown_env = " ".join(f"{k}={v}" for k, v in sorted(env.items()) if k.startswith("SLIPSTREAM_"))
    run.command = f"{shown_env} python {' '.join(argv)}"
    started = time.monotonic()
    if fork:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: output to the run's log, then the example
            fd = os.open(run.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(env)
            exec_example(argv)
        run.rc, run.timed_out = _wait(pid, started + timeout_s)
    else:
        with open(run.log, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.acceptance.resume", "--exec", *argv],
                                    cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
            try:
                run.rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                run.timed_out = True
    run.seconds = round(time.monotonic() - started, 2)
    return run


def copy_checkpoints_up_to(src: Path, dst: Path, step: int) -> list[int]:
    """Copy the complete checkpoints of steps <= ``step`` from src to a fresh dst: the
    directory a run killed right after step ``step``'s commit would leave."""
    from slipstream.checkpoint.layout import list_complete

    dst.mkdir(parents=True)
    kept = []
    for ckpt in list_complete(str(src)):
        if ckpt.step <= step:
            shutil.copytree(ckpt.path, dst / os.path.basename(ckpt.path))
            kept.append(ckpt.step)
    return kept


def main() -> None:
    if sys.argv[1:2] == ["--exec"]:  # --no-fork: one run in a fresh process
        exec_example(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--example", choices=sorted(EXAMPLES), required=True)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    p.add_argument("--every", type=int, default=2, help="checkpoint interval k; each run trains 3k steps")
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--run-timeout-s", type=float, default=120.0, help="per run")
    p.add_argument("--no-fork", action="store_true", help="start every run as a new python process")
    p.add_argument("example_args", nargs=argparse.REMAINDER, help="after --: arguments for the example (sizes)")
    args = p.parse_args()
    if args.every < 1:
        p.error(f"--every must be >= 1, got {args.every}")
    extra = [a for a in args.example_args if a != "--"]
    k, steps = args.every, 3 * args.every
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    import torch  # after argument errors; before the forks, so children inherit it imported
    import torch._dynamo  # noqa: F401 - torch.optim imports it lazily, about 1 s in every run; once here

    from slipstream.checkpoint.layout import list_complete

    script = str(ROOT / EXAMPLES[args.example])
    base_env = {
        "SLIPSTREAM_PRECISION": args.precision,
        # World size 1 on the training device's own backend: NCCL on a GPU, gloo on the CPU.
        "SLIPSTREAM_BACKEND": "nccl" if args.device == "cuda" else "gloo",
        "SLIPSTREAM_DEVICE": args.device,
        "SLIPSTREAM_LOG_EVERY_STEPS": "1",
        "SLIPSTREAM_CHECKPOINT_KEEP_LAST": "10",
        "SLIPSTREAM_PROGRESS": "0",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",  # deterministic cuBLAS; read when cuBLAS starts
        DETERMINISM_ENV: "strict",
    }
    checks: list[dict] = []
    runs: dict[str, Run] = {}

    def check(name: str, ok: bool, detail: str = "") -> bool:
        checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return ok

    fork = not args.no_fork
    figures: dict = {"steps": steps, "checkpoint_every": k, "determinism": "strict"}

    def launch(name: str, ckpt: Path | None, asynchronous: bool, start_step: int = 0) -> Run:
        nonlocal fork
        argv = [script, "--steps", str(steps), "--seed", "1", "--out", str(out / name), *extra]
        env = {**base_env, "SLIPSTREAM_RUN_DIR": str(out / name / "run")}
        if ckpt is not None:
            argv += ["--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", str(k)]
            env["SLIPSTREAM_CHECKPOINT_ASYNC"] = "1" if asynchronous else "0"

        def attempt() -> Run:
            env[DETERMINISM_ENV] = base_env[DETERMINISM_ENV]
            runs[name] = run_example(Run(name, log=out / f"{name}.log"), argv, env, args.run_timeout_s, fork=fork)
            return runs[name]

        run = attempt()
        for _ in range(2):  # at most one retry for each reason below
            text = run.tail(20_000)
            if run.ok:
                break
            if fork and CUDA_FORK_ERROR.search(text):
                # Something initialised CUDA in this parent before the fork (no import did
                # when this was written), and CUDA cannot start again in a forked child:
                # fresh processes from here on.
                fork = False
                figures["fork_fallback"] = f"{name}: CUDA could not start in a forked child; runs use new processes"
            elif name == "reference" and base_env[DETERMINISM_ENV] == "strict" and NO_DETERMINISTIC_OP.search(text):
                # An op of this example has no deterministic version: warn-only mode for every
                # run of this step (decided here, at the first run, so all runs use the same
                # kernels); the reference/sync_saves pair shows whether runs still reproduce.
                line = next((ln for ln in text.splitlines() if NO_DETERMINISTIC_OP.search(ln)), "")
                figures["determinism"] = f"warn_only (strict mode raised: {line.split(', but you set')[0].strip()[:200]})"
                base_env[DETERMINISM_ENV] = "warn"
            else:
                break
            shutil.rmtree(out / name, ignore_errors=True)  # the failed attempt's output
            if ckpt is not None:  # and whatever it saved: the retry must resume where this one did
                for partial in ckpt.glob("*.partial"):
                    shutil.rmtree(partial, ignore_errors=True)
                for saved in list_complete(str(ckpt)):
                    if saved.step > start_step:
                        shutil.rmtree(saved.path)
            run = attempt()
        state = f"exit {run.rc}" if not run.timed_out else f"timed out after {args.run_timeout_s:.0f} s"
        check(f"{name} runs", run.ok, f"{state}, {run.seconds} s")
        return run

    def resumed_at(run: Run, ckpt: Path, step: int) -> bool:
        seen = re.findall(r"resumed from (.+) at step (\d+)", run.tail(100_000))
        return check(f"{run.name} resumed at step {step}", (str(ckpt), str(step)) in seen,
                     f"log says {seen or 'no resume'}")

    started = time.monotonic()
    ref = launch("reference", None, False)
    sync_saves = launch("sync_saves", out / "ckpt_sync", False)
    if sync_saves.ok:
        saved = [c.step for c in list_complete(str(out / "ckpt_sync"))]
        check("sync_saves wrote complete checkpoints at k, 2k, 3k", saved == [k, 2 * k, 3 * k], f"steps {saved}")
        copy_checkpoints_up_to(out / "ckpt_sync", out / "ckpt_k", k)
        resume_k = launch("resume_k", out / "ckpt_k", True, start_step=k)
        if resume_k.ok:
            resumed_at(resume_k, out / "ckpt_k", k)
            saved = [c.step for c in list_complete(str(out / "ckpt_k"))]
            check("resume_k wrote complete checkpoints at 2k (async) and 3k", saved == [k, 2 * k, 3 * k], f"steps {saved}")
            copy_checkpoints_up_to(out / "ckpt_k", out / "ckpt_2k", 2 * k)
            resume_2k = launch("resume_2k", out / "ckpt_2k", True, start_step=2 * k)
            if resume_2k.ok:
                resumed_at(resume_2k, out / "ckpt_2k", 2 * k)

    if ref.ok:
        reference = torch.load(out / "reference" / "model.pt", map_location="cpu")
        finite = all(bool(torch.isfinite(v).all()) for v in reference.values() if v.is_floating_point())
        check("reference weights are finite", finite)
        losses = re.findall(r"final loss (\d+\.\d+|nan|inf)", ref.tail(100_000))
        if losses:
            figures["final_loss"] = float(losses[-1])
        equal = 0
        for name in ("sync_saves", "resume_k", "resume_2k"):
            run = runs.get(name)
            if run is None or not run.ok:
                check(f"{name} equals reference bitwise", False, "not compared: the run did not finish")
                continue
            problems = compare_states(reference, torch.load(out / name / "model.pt", map_location="cpu"))
            detail = "; ".join(problems[:4])
            if problems and name == "sync_saves":
                detail += " (two uninterrupted runs differ: nondeterminism or a checkpoint side effect)"
            if problems:
                mine, theirs = _settings_seen(run), _settings_seen(ref)
                detail += (f"; thread settings: both {mine}" if mine == theirs
                           else f"; thread settings differ: reference {theirs}, {name} {mine}")
            equal += check(f"{name} equals reference bitwise", not problems, detail or "torch.equal on every tensor")
        figures["bitwise_equal"] = f"{equal}/3"
    figures["run_seconds"] = {name: run.seconds for name, run in runs.items()}
    failed = [c for c in checks if not c["ok"]]
    result = {
        "status": "fail" if failed else "pass",
        "checks": checks,
        "figures": figures,
        "commands": [run.command for run in runs.values()],
        "seconds": round(time.monotonic() - started, 2),
    }
    if failed:
        bad = next((r for r in runs.values() if not r.ok), None)
        result["message"] = f"{failed[0]['name']}: {failed[0]['detail']}"
        if bad is not None:
            result["output_tail"] = f"--- {bad.name} ---\n{bad.tail()}"
            result["failed_log"] = str(bad.log)  # whole: the orchestrator looks for its stack there
    write_result(args.result, result)
    raise SystemExit(0 if not failed else 1)


if __name__ == "__main__":
    main()
