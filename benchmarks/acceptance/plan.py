"""The acceptance run's plan: its steps, what each trains per device, and what each costs.

Pure data and arithmetic, no torch (the orchestrator, benchmarks/gpu_acceptance.py, never
imports torch: it writes its report even when torch itself is broken).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Fixed so the JSON is checkable: pass, fail, skipped; a skip says which kind.
PASS, FAIL, SKIPPED = "pass", "fail", "skipped"
SKIP_DEVICE, SKIP_BUDGET, SKIP_SELECTION, SKIP_BLOCKED = "device", "budget", "selection", "blocked"


@dataclass
class Step:
    """One line of the report."""

    name: str
    estimate_s: float  # planned cost on this device, for the budget
    status: str = "pending"
    seconds: float = 0.0
    reason: str = ""  # why skipped or failed, one line
    skip_kind: str = ""
    figures: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    commands: list = field(default_factory=list)
    output_tail: str = ""
    options: dict = field(default_factory=dict)  # ranks steps: accelerate() options
    case: dict = field(default_factory=dict)  # ranks steps: what benchmarks/acceptance/ranks.py adds (train_one)
    # A failed step: the failing process's stack (benchmarks/acceptance/failures.py) and the command
    # that reruns just this step.
    stack: str = ""
    stack_summary: str = ""
    stack_source: str = ""
    rerun: str = ""

    def skip(self, kind: str, reason: str) -> None:
        self.status, self.skip_kind, self.reason = SKIPPED, kind, reason

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("options")
        out.pop("case")
        out.pop("estimate_s")
        if self.status != FAIL:
            for key in ("output_tail", "stack", "stack_summary", "stack_source", "rerun"):
                out.pop(key)
        out["command"] = self.commands[0] if len(self.commands) == 1 else self.commands
        out.pop("commands")
        return out


@dataclass
class Sizes:
    """What each step trains, per device (scaled by --steps-scale)."""

    example_args: dict[str, list[str]]
    every: int  # checkpoint interval k of the resume steps (they run 3k steps)
    ranks_model: dict
    ranks_steps: int
    perf_args: list[str]
    overhead_args: list[str]


def sizes_for(device: str, scale: float) -> Sizes:
    def steps(n: int, least: int) -> int:
        return max(least, int(round(n * scale)))

    if device == "cuda":
        gpt = ["--batch-size", "8", "--layers", "2", "--dim", "128", "--context", "64", "--corpus-mb", "0.5"]
        resnet = ["--batch-size", "16", "--width", "16"]
        model = {"dim": 128, "layers": 2, "heads": 4, "context": 64, "batch": 8}
        perf = ["--warmup", str(steps(3, 1)), "--steps", str(steps(10, 2)), "--rounds", "3"]
        # The overhead step's own defaults are the GPU's model (benchmarks/acceptance/overhead.py).
        # 10 warm-up and 40 timed steps per run, four runs: about 4 x 50 x 48 ms of training on an H200.
        overhead = ["--warmup", str(steps(10, 2)), "--steps", str(steps(40, 5))]
    else:
        # Tiny, and k = 1 (3 steps a run): on 2 busy cores the examples' fixed costs
        # (start-up, checkpoints) already take most of CI's few minutes, and a bf16
        # convolution on a CPU without native bf16 costs about 1 s per step at width 8.
        gpt = ["--batch-size", "4", "--layers", "2", "--dim", "64", "--context", "32", "--corpus-mb", "0.2"]
        resnet = ["--batch-size", "4", "--width", "4"]
        model = {"dim": 64, "layers": 2, "heads": 4, "context": 32, "batch": 8}
        # Small: CPU timings on a shared machine are noise, and bf16 matmuls have no
        # native support on most CPUs (about 10x slower than fp32 here). What CI
        # proves is that the measurement runs; the figures that matter come from a GPU.
        perf = ["--dim", "64", "--layers", "1", "--context", "32", "--batch", "4",
                "--warmup", str(steps(1, 1)), "--steps", str(steps(3, 2)), "--rounds", "2"]
        overhead = ["--dim", "64", "--layers", "2", "--heads", "4", "--seq", "32", "--batch", "4", "--vocab", "512",
                    "--warmup", str(steps(2, 1)), "--steps", str(steps(5, 2))]
    every = steps(2, 1) if device == "cuda" else steps(1, 1)
    return Sizes({"gpt": gpt, "resnet": resnet}, every, model, steps(4 if device == "cuda" else 3, 2), perf, overhead)


# 2-rank layouts (docs/parallel.md); DDP itself is sync/allreduce. Options go to accelerate().
LAYOUTS_2 = {
    "ddp-bf16": {"precision": "bf16"},
    "ddp-fp16": {"precision": "fp16"},  # the gradient scaler's inf check crosses ranks
    "fsdp": {"dp_shard": 2},
    "fsdp-zero2": {"dp_shard": 2, "zero_stage": 2},
    "fsdp-bf16": {"dp_shard": 2, "precision": "bf16"},
    "fsdp-activation-ckpt": {"dp_shard": 2, "activation_checkpointing": ["Block"]},
    "tp": {"tp": 2},
    "tp-bf16": {"tp": 2, "precision": "bf16"},
    "pp-gpipe": {"pp": 2, "pp_schedule": "gpipe"},
    "pp-1f1b": {"pp": 2, "pp_schedule": "1f1b", "pp_microbatches": 4},
}
LAYOUTS_4 = {
    "fsdp2xtp2": {"dp_shard": 2, "tp": 2},
    "hsdp2x2": {"dp_replicate": 2, "dp_shard": 2},
    "pp2xfsdp2": {"pp": 2, "dp_shard": 2},
    "tp2xpp2": {"tp": 2, "pp": 2},
    # DiLoCo across 2 replicas, FSDP2 over dp_shard inside each (issue #35): its inner_steps
    # comes from sync_options, so the run ends on an outer step (equal digests everywhere)
    "diloco-2x2": {"dp_replicate": 2, "dp_shard": 2, "sync": "diloco"},
}

def sync_options(strategy: str, steps: int) -> dict:
    """A step's options for ``strategy``: diloco's replicas differ between outer steps by design, so
    its period divides the run's steps and the run ends on an outer step (where the ranks' parameter
    digests must be equal, as every other strategy's)."""
    options: dict = {"sync": strategy}
    if strategy == "diloco":
        options["sync_options"] = {"inner_steps": steps // 2 if steps >= 2 and steps % 2 == 0 else max(1, steps)}
    return options


def layout_options(options: dict, steps: int) -> dict:
    """A layout step's options: one that names a sync strategy gets that strategy's (diloco: an
    inner_steps dividing the run's steps)."""
    return {**options, **sync_options(options["sync"], steps)} if "sync" in options else options


def conformance_steps(strategies: list[str], steps: int, estimate_s: float) -> list[Step]:
    """Issue #32's cases, 2 ranks (benchmarks/acceptance/ranks.py's ``case``):

    * bf16-params/<strategy>: the model's parameters in bf16 under every sync strategy;
    * resume/async-final-save+<codec>: an asynchronous save on the first launch's final step,
      a resume there, then compressed steps (powersgd, topk);
    * resume/async-final-save/<layout>: the same on FSDP2 and tp (DCP saving and loading
      DTensors from device memory; under gloo + CUDA too, where the state-dict gather once
      crashed);
    * fp16-ef/scale-change/<codec>: fp16 with error feedback across a forced loss-scale change
      (scale x 2**-8 after step 1), against the same run without the change.
    """
    at = max(1, steps // 2)
    out = [Step(f"conformance/bf16-params/{s}", estimate_s, options=sync_options(s, steps), case={"param_dtype": "bf16"})
           for s in strategies]
    out += [Step(f"conformance/resume/async-final-save+{c}", 2 * estimate_s, options={"sync": c},
                 case={"resume_at": at}) for c in ("powersgd", "topk")]
    out += [Step(f"conformance/resume/async-final-save/{name}", 2 * estimate_s, options=opts, case={"resume_at": at})
            for name, opts in (("fsdp", {"dp_shard": 2}), ("tp", {"tp": 2}))]
    out += [Step(f"conformance/fp16-ef/scale-change/{c}", 2 * estimate_s, options={"sync": c, "precision": "fp16"},
                 case={"force_scale": {"at": 1, "factor": 2.0 ** -8}}) for c in ("allreduce", "powersgd", "topk")]
    return out


def pipelined(step_name: str) -> bool:
    """Whether a ``layout/<name>`` step has pipeline stages (pp > 1)."""
    name = step_name.split("/", 1)[1] if step_name.startswith("layout/") else ""
    return {**LAYOUTS_2, **LAYOUTS_4}.get(name, {}).get("pp", 1) > 1


# Planned seconds per step kind and device. "launch" is a ranks launch's start-up (processes,
# torch, the first configuration's CUDA and cuBLAS start), "config2"/"config4" each configuration
# after it, "reference"/"reference_key" the loss references' process and each reference in it.
#
# cuda: from the H200 runs of 2026-12-04 (console.log of run 2, same commit 379261e): environment
# 5.8 s; examples 15.0-18.1 s each; perf 44.3 s; nccl 10.0 s; binding 4.1 s; a 2-rank launch
# 17.4 s for 17 configurations of which the first took 4.8 s (CUDA start) and the rest 0.1-1.1 s;
# 4-rank launches 12.3-13.7 s to their first (crashing) configuration. Each figure is the
# measurement rounded up with some room, never several times it: the sum must say whether the
# kit fits its 7 minutes (the default --budget-s), and it prints that sum before it starts.
# overhead is new: 4 runs x 50 steps x ~48 ms of a 167M-parameter model plus start-ups (~20 s).
# cpu: from the 2-core CI machine, where timings swing by several times.
ESTIMATES = {
    # nccl: the refusal comes as the launch starts, whose cost "launch" already counts.
    "cuda": {"environment": 10, "example": 20, "perf": 50, "overhead": 35, "launch": 15, "config2": 1,
             "config4": 3, "nccl": 1, "binding": 8, "reference": 10, "reference_key": 0.5},
    "cpu": {"environment": 15, "example": 25, "perf": 30, "overhead": 20, "launch": 20, "config2": 3, "config4": 8,
            "nccl": 0, "binding": 20, "reference": 15, "reference_key": 1},
}


@dataclass
class Group:
    """Ranks steps that share launches: same number of ranks, same environment."""

    nproc: int
    env: dict[str, str]
    steps: list[Step]
    nccl_refusal: bool = False  # the step passes if the launch is refused with a clear error
