"""One benchmark worker: trains a workload under several systems, side by side.

Started on every rank by ``benchmarks.run`` (through ``slipstream run``, in an
emulated cluster or on one node)::

    slipstream run --emulate 2x1 --link 1gbit -m benchmarks.train_worker \\
        --workload mlp --systems floor,ddp,ddp_bf16 --repeats 3 --steps 20 --out r.json

Systems (all in the same training loop, same data, same initial weights):

=====================  ===================================================================
``floor``              no communication at all: each rank trains its own copy. With all
                       ranks running at once it is the physical floor of a data-parallel
                       step on this machine (same CPU share, zero network).
``ddp``                DDP with a tuned bucket size (the fastest of ``--bucket-sweep``).
``ddp_bf16``           DDP (tuned bucket) + torch's ``bf16_compress_hook``.
``ddp_hook_allreduce``  DDP (tuned bucket) + torch's own ``allreduce_hook``: not a peer, the
                       measure of what any comm hook costs over DDP's built-in all-reduce
                       (with no hook DDP divides each gradient as it lands in the bucket;
                       with one, the hook divides the whole bucket in its own pass).
``ddp_powersgd``       DDP + torch's ``powerSGD_hook``, rank 4, one bucket (it aborts under
                       gloo with more), start_powerSGD_iter 2, error feedback, warm start.
``deepspeed_z0/_z2``   DeepSpeed engine, ZeRO stage 0 / 2 (DS_ACCELERATOR=cpu on CPUs).
``slipstream:NAME``    DDP with the same tuned bucket as ``ddp`` + ``slipstream.sync.apply(NAME)``
                       (the bucket is DDP's setting, not the sync engine's: with Slipstream's
                       default of 25 MiB against the peers' tuned 5 MiB, the bucket alone
                       made 1.11x on the MLP at 2x1, 1 Gbit/s; ``--slipstream-bucket default``
                       runs them on the default instead).
=====================  ===================================================================

Repeats are interleaved (A B C, B C A, C A B, ...) so that a noisy neighbour on
the shared machine hurts every system alike. Per run, rank 0 records every
step's wall time and loss; the local rank 0 of each node reads its shaped
interface's ``tx_bytes`` (and loopback's) before and after the timed steps.
Rank 0 writes one JSON file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks import workloads

_MB = 2**20


def _tx(ifname: str | None) -> int | None:
    if not ifname:
        return None
    try:
        with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as fh:
            return int(fh.read())
    except OSError:
        return None


def _counters() -> dict[str, int | None]:
    return {"if": _tx(os.environ.get("SLIPSTREAM_EMULATED_IFNAME")), "lo": _tx("lo")}


def _torch_bf16_hook(state, bucket):
    """torch's own ``bf16_compress_hook``, called through a wrapper.

    DDP.register_comm_hook refuses that hook *by name* unless CUDA + NCCL 2.10
    are present ("BF16 all reduce communication hook required CUDA 11+ and NCCL
    2.10+"); the hook's code itself runs on gloo, which all-reduces bf16. The
    wrapper only changes the name, so the baseline is torch's hook, unmodified.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


class System:
    """A model wrapped for one system; ``step(x, y)`` does forward, backward, update."""

    def __init__(self, name: str, work: workloads.Workload, bucket_cap_mb: float | None):
        self.name = name
        self.work = work
        self.state = None
        self.engine = None
        model = work.build()
        if name == "floor":
            self.model = model
            self.opt = work.optimizer(list(model.parameters()))
        elif name.startswith("deepspeed_z"):
            self._deepspeed(model, int(name[-1]))
        elif name in ("ddp", "ddp_bf16", "ddp_hook_allreduce"):
            self.model = DDP(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
            if name == "ddp_bf16":
                self.model.register_comm_hook(None, _torch_bf16_hook)
            elif name == "ddp_hook_allreduce":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                self.model.register_comm_hook(None, default_hooks.allreduce_hook)
            self.opt = work.optimizer(list(self.model.parameters()))
        elif name == "ddp_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            one_bucket_mb = workloads.grad_bytes(model) / _MB + 1
            self.model = DDP(model, bucket_cap_mb=one_bucket_mb, gradient_as_bucket_view=True)
            self.state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                use_error_feedback=True, warm_start=True,
            )
            self.model.register_comm_hook(self.state, powerSGD_hook.powerSGD_hook)
            self.opt = work.optimizer(list(self.model.parameters()))
        elif name.startswith("slipstream:"):
            from slipstream import sync
            from slipstream.config import TrainConfig

            cap = bucket_cap_mb if bucket_cap_mb is not None else TrainConfig().sync.bucket_cap_mb
            self.model = DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=True)
            self.state = sync.apply(name.split(":", 1)[1], self.model)
            self.opt = work.optimizer(list(self.model.parameters()))
        else:
            raise KeyError(f"unknown system {name!r}")

    def _deepspeed(self, model: torch.nn.Module, stage: int) -> None:
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
        bucket = int(max(workloads.grad_bytes(model) // 4 + 1, 5e7))
        config = {
            "train_micro_batch_size_per_gpu": self.work.samples_per_batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": bucket,
                "allgather_bucket_size": bucket,
                "overlap_comm": False,
                "contiguous_gradients": True,
            },
            "zero_allow_untested_optimizer": True,
            # DeepSpeed clips the gradient norm to 1.0 unless told otherwise
            # (GRADIENT_CLIPPING_DEFAULT = 1.0 in 0.19); no other system clips.
            "gradient_clipping": 0.0,
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        opt = self.work.optimizer(list(model.parameters()))
        self.engine, self.opt, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=config, dist_init_required=False
        )
        self.model = self.engine

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.work.loss(self.model(x), y)
        if self.engine is not None:
            self.engine.backward(loss)
            self.engine.step()
        else:
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
        if self.state is not None and hasattr(self.state, "observe_loss"):
            self.state.observe_loss(loss.detach())
        return loss

    def close(self) -> None:
        if self.engine is not None and hasattr(self.engine, "destroy"):
            self.engine.destroy()


def run_once(name: str, work: workloads.Workload, steps: int, warmup: int, bucket_cap_mb: float | None) -> dict:
    """Train ``steps`` steps (the first ``warmup`` untimed for step time) and measure."""
    rank = dist.get_rank()
    system = System(name, work, bucket_cap_mb)
    losses: list[float] = []
    times: list[float] = []
    before = None
    dist.barrier()
    for step in range(steps):
        if step == warmup:
            dist.barrier()
            before = _counters()
        x, y = work.batch(step, rank)
        t0 = time.perf_counter()
        loss = system.step(x, y)
        # The loss read is a host sync; on CPU it costs nothing and every system pays it.
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - t0)
    after = _counters()
    dist.barrier()
    stats = system.state.stats() if system.state is not None and hasattr(system.state, "stats") else None
    system.close()
    local = {
        "node": int(os.environ.get("SLIPSTREAM_EMULATED_NODE", os.environ.get("GROUP_RANK", "0"))),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "if_bytes": None if before is None or before["if"] is None else after["if"] - before["if"],
        "lo_bytes": None if before is None or before["lo"] is None else after["lo"] - before["lo"],
        "step_times_s": times,
    }
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, local)
    per_node = {g["node"]: g for g in gathered if g["local_rank"] == 0}
    timed = steps - warmup
    return {
        "system": name,
        "bucket_cap_mb": bucket_cap_mb,
        "steps": steps,
        "warmup_steps": warmup,
        "losses": losses,
        "step_times_s": times,
        # A step ends when the slowest rank is done: take the max over ranks per step.
        "step_times_max_s": [max(g["step_times_s"][i] for g in gathered) for i in range(steps)],
        "median_step_s": statistics.median(
            max(g["step_times_s"][i] for g in gathered) for i in range(warmup, steps)
        ),
        "wire_bytes_per_step_per_node": {
            str(n): (g["if_bytes"] / timed if g["if_bytes"] is not None else None) for n, g in sorted(per_node.items())
        },
        "loopback_bytes_per_step_per_node": {
            str(n): (g["lo_bytes"] / timed if g["lo_bytes"] is not None else None) for n, g in sorted(per_node.items())
        },
        "sync_stats": _jsonable(stats),
    }


def _jsonable(obj):
    try:
        return json.loads(json.dumps(obj, default=str))
    except (TypeError, ValueError):
        return str(obj)


def tune_bucket(work: workloads.Workload, sweep: list[float], steps: int) -> tuple[float, dict]:
    """DDP's bucket size for this workload and link: the fastest of ``sweep`` (median step)."""
    results = {}
    for cap in sweep:
        r = run_once("ddp", work, steps, warmup=2, bucket_cap_mb=cap)
        results[str(cap)] = r["median_step_s"]
    best = min(sweep, key=lambda c: results[str(c)])
    return best, results


def main() -> None:
    p = argparse.ArgumentParser(description="benchmark worker (one rank)")
    p.add_argument("--workload", default="mlp")
    p.add_argument("--systems", default="floor,ddp")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-sweep", default="5,25,100", help="DDP bucket sizes (MiB) to tune over")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (the measuring rules use 1: docs/measuring.md)")
    p.add_argument("--slipstream-bucket", choices=("tuned", "default"), default="tuned",
                   help="DDP bucket of the slipstream:* systems: the peers' tuned one, or Slipstream's default")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = workloads.get(args.workload)
    systems = [s for s in args.systems.split(",") if s]

    sweep = [float(c) for c in args.bucket_sweep.split(",") if c]
    slip_tuned = args.slipstream_bucket == "tuned"
    needs_tuning = any(s in ("ddp", "ddp_bf16", "ddp_hook_allreduce") or (slip_tuned and s.startswith("slipstream:")) for s in systems)
    tuned, sweep_result = (tune_bucket(work, sweep, max(6, args.warmup + 3)) if needs_tuning and len(sweep) > 1
                           else (sweep[0] if sweep else 25.0, {}))

    runs: list[dict] = []
    for rep in range(args.repeats):
        k = rep % len(systems)
        for name in systems[k:] + systems[:k]:
            # A system that fails fails the whole job: the ranks cannot agree to skip it
            # once one of them is gone. benchmarks.run then retries the systems one by one.
            tuned_here = name.startswith("ddp") or (slip_tuned and name.startswith("slipstream:"))
            r = run_once(name, work, args.steps, args.warmup, tuned if tuned_here else None)
            r["bucket_cap_mb"] = tuned if tuned_here and name != "ddp_powersgd" else None  # that one: one bucket
            r["repeat"] = rep
            runs.append(r)

    if rank == 0:
        model = work.build()
        doc = {
            "kind": "train",
            "workload": args.workload,
            "world_size": world,
            "nodes": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
            "procs_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            "grad_bytes": workloads.grad_bytes(model),
            "params": sum(q.numel() for q in model.parameters()),
            "samples_per_step": work.samples_per_batch * world,
            "threads_per_rank": args.threads,
            "tuned_bucket_cap_mb": tuned,
            "slipstream_bucket": args.slipstream_bucket,
            "bucket_sweep_median_step_s": sweep_result,
            "runs": runs,
            "host": platform.node(),
            "torch": torch.__version__,
        }
        tmp = args.out + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip interpreter teardown, where torch's gloo can abort (see slipstream.shutdown).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
