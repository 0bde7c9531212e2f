"""The host work Slipstream's ``train_step`` adds to a step, at world size 1 (issue #42).

    PYTHONPATH=src python benchmarks/host_overhead.py                 # CPU, gloo group of 1
    PYTHONPATH=src python benchmarks/host_overhead.py --no-breakdown --rounds 9
    PYTHONPATH=src python benchmarks/host_overhead.py --device cuda   # a GPU: the same, on the host side
    PYTHONPATH=src python benchmarks/host_overhead.py --device cuda --shape gpt167m --steps 20 --rounds 3 \
        --warmup 5 --no-breakdown      # the H200 run's 167M decoder: step time by CUDA events, last losses, peak memory

Why host work matters: on a GPU the step is asynchronous, so host work the
wrapper adds either hides behind the GPU's queue or, once the host falls behind
(small kernels, a host sync that drains the queue), adds to every step. The
model here is tiny on purpose (a decoder from ``torch.nn`` with the tensor
count of the 167M one of the H200 run: 8 layers, 100 parameter tensors, but
width 16, 8 tokens): compute is negligible, so a step's time is host work.

Three loops over the same model, data and optimizer (AdamW, ``foreach=True``:
the CUDA default, which the CPU does not take by itself), bf16 autocast:

* ``plain``: ``loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()``;
* ``ddp``: the same with the model in torch's own ``DistributedDataParallel``
  (world size 1; its reducer still copies, reduces and broadcasts), for reference;
* ``slipstream``: ``slipstream.init()`` + ``accelerate(model, opt, precision="bf16")``
  + ``run.train_step(x, y, loss_fn)``, default settings (profiler on, a log step
  every 10 steps, JSONL records in a temporary run directory).

Each round runs ``--steps`` steps of each loop, in an order that rotates from
round to round; the figure of a loop is the median over rounds of its mean
step time, by the training thread's CPU time (the host work itself, robust on a
shared machine) and by the wall clock (on a GPU: CUDA events around each block).
Every loop sees the same batches in the same order, so their last losses agree
when the arithmetic does. It prints::

    host work per step: X us (plain loop Y us, Slipstream Z us)

with X = Z - Y, and the DDP share. Then (``--breakdown``, on by default):

* ops per step that Slipstream adds (torch.profiler's op counts, Slipstream
  minus plain): on a GPU each is a kernel launch or a copy, and
  ``aten::_local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``) is a host
  sync that stalls the queue;
* cProfile of Slipstream's steps: the Python functions of Slipstream and of
  torch's DDP by their own time per step (cProfile's own cost inflates every
  figure alike: read them as shares).

Run it on a quiet machine; to compare two commits, run it at each (``PYTHONPATH``
at each checkout's ``src``), alternating.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script: python benchmarks/host_overhead.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer from torch.nn (pre-norm, causal, untied head)."""

    vocab: int = 64
    d_model: int = 16
    layers: int = 8
    heads: int = 2
    seq: int = 8
    batch: int = 2


TINY = Shape()
# The held-out model of the first GPU run (167.4M parameters; docs/gpu.md, run 1).
GPT167M = Shape(vocab=32000, d_model=1024, layers=8, heads=16, seq=1024, batch=16)


class Decoder(nn.Module):
    def __init__(self, shape: Shape) -> None:
        super().__init__()
        self.tok = nn.Embedding(shape.vocab, shape.d_model)
        self.pos = nn.Embedding(shape.seq, shape.d_model)
        layer = nn.TransformerEncoderLayer(shape.d_model, shape.heads, 4 * shape.d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, shape.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(shape.d_model)
        self.head = nn.Linear(shape.d_model, shape.vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(shape.seq), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos.weight[: ids.shape[1]]
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def build(shape: Shape, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Decoder(shape).to(device)
    fused = device.type == "cuda"  # the H200 run's fused AdamW; foreach (the CUDA default) on the CPU
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)
    return model, opt


def batches(shape: Shape, device: torch.device, n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g).to(device)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


Step = Callable[[torch.Tensor, torch.Tensor], Any]


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device, precision: str) -> Step:
    dtype = torch.bfloat16 if precision == "bf16" else None

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    step.model = model  # type: ignore[attr-defined]
    return step


def loops(shape: Shape, device: torch.device, precision: str, run_dir: str) -> dict[str, Step]:
    """The three loops of the module docstring, each over its own copy of the model."""
    import slipstream
    from torch.nn.parallel import DistributedDataParallel

    model, opt = build(shape, device)
    out = {"plain": plain_step(model, opt, device, precision)}
    model, _ = build(shape, device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=True)  # as Slipstream configures it
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, fused=device.type == "cuda",
                            foreach=None if device.type == "cuda" else True)
    out["ddp"] = plain_step(ddp, opt, device, precision)
    model, opt = build(shape, device)
    run = slipstream.accelerate(model, opt, precision=precision, progress=False, run_dir=run_dir)
    out["slipstream"] = lambda x, y: run.train_step(x, y, loss_fn)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """A block's duration: on a GPU from CUDA events around it (the device's time: the host only
    enqueues), on the CPU from the host clock; and the training thread's CPU time either way."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> tuple[Any, float, float]:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return event, time.perf_counter(), time.thread_time()

    def stop(self, started: tuple[Any, float, float]) -> tuple[float, float]:
        """(wall or device seconds, CPU seconds) since ``started``."""
        event, w0, c0 = started
        cpu = time.thread_time() - c0
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()  # between blocks, outside the timed steps
            return event.elapsed_time(end) / 1e3, cpu
        return time.perf_counter() - w0, cpu


def timed_rounds(steps_of: dict[str, Step], data: list, device: torch.device, steps: int,
                 rounds: int, warmup: int) -> tuple[dict[str, dict[str, list[float]]], dict[str, float]]:
    """Mean seconds per step of each loop in each round, by two clocks: ``cpu``, this (the
    training) thread's CPU time, which is the host work itself and robust on a shared
    machine; ``wall``, the block's wall clock on the CPU, its device time (CUDA events) on a
    GPU. Also each loop's last loss (every loop sees the same batches in the same order)."""
    names = list(steps_of)
    clock = _Clock(device)
    last: dict[str, Any] = {}
    for name in names:
        for i in range(warmup):
            last[name] = steps_of[name](*data[i % len(data)])
    _sync(device)
    per_round: dict[str, dict[str, list[float]]] = {name: {"cpu": [], "wall": []} for name in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            fn = steps_of[name]
            _sync(device)
            started = clock.start()
            for i in range(steps):
                last[name] = fn(*data[i % len(data)])
            wall, cpu = clock.stop(started)
            per_round[name]["cpu"].append(cpu / steps)
            per_round[name]["wall"].append(wall / steps)
    return per_round, {name: float(loss) for name, loss in last.items()}


def op_counts(fn: Step, data: list, steps: int) -> collections.Counter[str]:
    """Ops per step (torch.profiler, CPU side: each op a GPU would launch is counted once)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            fn(*data[i % len(data)])
    counts: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        counts[event.name] += 1
    return counts


def python_breakdown(fn: Step, data: list, steps: int, top: int) -> list[tuple[str, float, int]]:
    """(function, own microseconds per step, calls per step) of Slipstream's and DDP's Python."""
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(steps):
        fn(*data[i % len(data)])
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = []
    for (path, line, name), (_cc, calls, tottime, _cum, _callers) in stats.items():
        where = path.replace(os.sep, "/")
        if "/slipstream/" in where or where.endswith("torch/nn/parallel/distributed.py"):
            short = where.split("/slipstream/", 1)[-1] if "/slipstream/" in where else "torch DDP"
            rows.append((f"{short}:{line} {name}", tottime / steps * 1e6, round(calls / steps)))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="tiny", choices=["tiny", "gpt167m"],
                   help="tiny: compute negligible, a step is host work; gpt167m: the H200 run's model (a GPU)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=200, help="steps of each loop per round")
    p.add_argument("--rounds", type=int, default=7, help="rounds; each loop's figure is the median over them")
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the shared 2-core machine)")
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                   help="also the op counts and the cProfile breakdown")
    p.add_argument("--profile-steps", type=int, default=50, help="steps of each profiled run (a log step every 10)")
    args = p.parse_args(argv)

    import slipstream

    torch.set_num_threads(args.threads)
    rt = slipstream.init(device=args.device)
    if rt.world_size != 1:
        raise SystemExit("host_overhead measures world size 1: run it as one process")
    device = rt.device
    shape = GPT167M if args.shape == "gpt167m" else TINY
    data = batches(shape, device)
    with tempfile.TemporaryDirectory(prefix="slipstream-host-") as run_dir:
        steps_of = loops(shape, device, args.precision, run_dir)
        per_round, last_loss = timed_rounds(steps_of, data, device, args.steps, args.rounds, args.warmup)
        tensors = sum(1 for _ in steps_of["plain"].model.parameters())  # type: ignore[attr-defined]
        print(f"world size 1, {rt.backend} on {device}, {args.precision}, {args.shape} decoder ({tensors} parameter "
              f"tensors), {args.rounds} rounds x {args.steps} steps, medians of per-round means, microseconds per step")
        med = {clock: {name: statistics.median(v[clock]) * 1e6 for name, v in per_round.items()}
               for clock in ("cpu", "wall")}
        wall_label = "device time (CUDA events)" if device.type == "cuda" else "wall clock"
        for clock, label in (("cpu", "training thread's CPU time"), ("wall", wall_label)):
            print(f"  {label}:")
            for name, values in per_round.items():
                print(f"    {name:<10} {med[clock][name]:8.1f}   rounds: "
                      + ", ".join(f"{v * 1e6:.0f}" for v in values[clock]))
        cpu, wall = med["cpu"], med["wall"]
        print(f"host work per step: {cpu['slipstream'] - cpu['plain']:.1f} us "
              f"(plain loop {cpu['plain']:.1f} us, Slipstream {cpu['slipstream']:.1f} us)")
        print(f"  {wall_label}: {wall['slipstream'] - wall['plain']:+.1f} us "
              f"({(wall['slipstream'] / wall['plain'] - 1) * 100:+.1f} %); for reference, torch's own DDP loop "
              f"(which reduces even at world size 1): {cpu['ddp'] - cpu['plain']:+.1f} us over the plain loop")
        print("  last loss: " + ", ".join(f"{name} {loss:.6f}" for name, loss in last_loss.items()))
        if device.type == "cuda":
            print(f"  torch.cuda.max_memory_allocated() after the run: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB "
                  "(the process's peak: Slipstream never resets it)")
        if args.breakdown:
            n = args.profile_steps
            plain = op_counts(steps_of["plain"], data, n)
            slip = op_counts(steps_of["slipstream"], data, n)
            diff = {k: (slip[k] - plain[k]) / n for k in set(plain) | set(slip) if slip[k] != plain[k]}
            print(f"\nops per step, Slipstream minus plain ({n} steps each; a log step every 10):")
            for name, d in sorted(diff.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:30]:
                print(f"  {d:+7.2f}  {name}")
            syncs = slip["aten::_local_scalar_dense"] / n
            print(f"host syncs per step under Slipstream (aten::_local_scalar_dense): {syncs:.2f} "
                  f"(plain {plain['aten::_local_scalar_dense'] / n:.2f})")
            print(f"\nPython under Slipstream's train_step, own time per step (cProfile, {n} steps; inflated alike):")
            for where, us, calls in python_breakdown(steps_of["slipstream"], data, n, top=30):
                print(f"  {us:7.1f} us  x{calls:<3d} {where}")
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
