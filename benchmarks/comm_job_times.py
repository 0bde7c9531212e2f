"""Where a compressed step's time goes: each comm-thread job of a Slipstream strategy, timed.

Two ranks on loopback (gloo), one thread each, the benchmark's workload under DDP and
``slipstream.sync.apply(STRATEGY)``. Every job the engine puts on its ordering thread is
timed from submission (the bucket became ready) to start and to end, relative to the end
of forward; the same steps are run with no communication (the floor). It shows what the
machine limit of BENCHMARKS.md leaves out: in the run, a codec's compute shares its core
with backward and with the other rank, so its jobs take longer than the codec timed alone
(``benchmarks/codec_cost.py``), and the last bucket's job is exposed after backward.

    python benchmarks/comm_job_times.py --strategy powersgd --steps 25 --out jobs.json

Prints, per strategy, the median step and backward (including the wait for the last
bucket), and for two steady steps every job's submit/start/end times (ms after forward).
CPU only; the figures are host times of a CPU run (on a GPU the jobs only enqueue work).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, strategy: str, workload: str, steps: int, bucket_mb: float,
            out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks import workloads

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    work = workloads.get(workload)
    model = work.build()
    jobs: list[tuple[float, float, float]] = []
    if strategy == "floor":
        net, state = model, None
    else:
        from slipstream import sync
        from slipstream.sync.ordering import OrderedQueue

        submit = OrderedQueue.submit

        def timed_submit(queue, fn):  # every job of the engine's ordering thread, timed
            t_sub = time.perf_counter()

            def run():
                a = time.perf_counter()
                try:
                    return fn()
                finally:
                    jobs.append((t_sub, a, time.perf_counter()))

            return submit(queue, run)

        OrderedQueue.submit = timed_submit  # this worker process only

        net = DDP(model, bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
        state = sync.apply(strategy, net)
    opt = work.optimizer(list(net.parameters()))
    step_s, backward_s, timed = [], [], []
    for step in range(steps):
        x, y = work.batch(step, rank)
        t0 = time.perf_counter()
        loss = work.loss(net(x), y)
        t1 = time.perf_counter()
        jobs.clear()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        float(loss.detach())
        t3 = time.perf_counter()
        if step >= 5:
            step_s.append(t3 - t0)
            backward_s.append(t2 - t1)
            if step in (10, 11):
                timed.append([{"submit_ms": (s - t1) * 1e3, "start_ms": (a - t1) * 1e3, "end_ms": (b - t1) * 1e3}
                              for s, a, b in jobs])
    if rank == 0:
        Path(out).write_text(json.dumps({"strategy": strategy, "median_step_ms": statistics.median(step_s) * 1e3,
                                         "median_backward_ms": statistics.median(backward_s) * 1e3,
                                         "jobs": timed}))
    if state is not None and hasattr(state, "close"):
        state.close()
    dist.destroy_process_group()


def measure(strategy: str, workload: str = "mlp", steps: int = 25, bucket_mb: float = 5.0) -> dict:
    """One 2-rank run of ``strategy`` (or ``floor``); rank 0's figures."""
    import tempfile

    import torch.multiprocessing as mp

    if steps < 12:
        raise ValueError(f"steps must be >= 12 (steps 10 and 11 are shown), got {steps}")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rank0.json")
        mp.spawn(_worker, args=(2, _free_port(), strategy, workload, steps, bucket_mb, out), nprocs=2)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="powersgd", help="a slipstream.sync strategy (default powersgd)")
    p.add_argument("--workload", default="mlp", choices=("mlp", "gpt", "resnet"))
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--bucket-mb", type=float, default=5.0, help="DDP bucket_cap_mb (default 5, the tuned MLP bucket)")
    p.add_argument("--out", type=Path, help="write both runs' figures as JSON here")
    args = p.parse_args(argv)
    if args.steps < 12:
        p.error(f"--steps must be >= 12 (steps 10 and 11 are shown), got {args.steps}")
    runs = [measure(s, args.workload, args.steps, args.bucket_mb) for s in ("floor", args.strategy)]
    for r in runs:
        print(f"{r['strategy']}: median step {r['median_step_ms']:.1f} ms, backward (with the wait for the "
              f"last bucket) {r['median_backward_ms']:.1f} ms")
        for i, jobs in enumerate(r["jobs"]):
            if jobs:
                total = sum(j["end_ms"] - j["start_ms"] for j in jobs)
                print(f"  step {10 + i}: {len(jobs)} jobs, {total:.1f} ms in all")
            for j in jobs:
                print(f"    submitted {j['submit_ms']:6.1f}  started {j['start_ms']:6.1f}  ended {j['end_ms']:6.1f}  "
                      f"ran {j['end_ms'] - j['start_ms']:5.1f} ms")
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
