"""Compute time of each gradient codec on a workload's model, one core, no communication.

    python benchmarks/codec_cost.py [--workload mlp] [--codecs powersgd,sign,topk,bf16] [--repeats 20]
    python -m benchmarks.codec_cost --workload gpt --world-sizes 2,4 --json figures.json
    python -m benchmarks.codec_cost --workload resnet --retained-steps 1,2,3,8,20

Prints, per codec, the median time of one ``reduce`` on a one-rank wire of all
the model's gradients (layout-aware, warm-start state after three untimed calls,
a fresh copy of the same random gradient each call), next to the floor step
(forward + backward + optimizer) of the same model in the same process, and the
codec's wire bytes per rank and step at each world size n (the codec's own
accounting, ``Codec.wire_bytes``: ring formulas of ``slipstream.network.link``, e.g.
2(n-1)/n * S for an all-reduce of S bytes). With one core per rank this time
adds to every compressed step. Run it on a quiet machine; to compare two
commits, run it at each.

:func:`measure` is the reusable part: ``benchmarks.run`` calls it (through this
CLI, ``--json``) once per workload, and ``benchmarks.report.machine_limit``
turns its figures into the machine limit of each table cell. Codecs are built
as ``auto`` builds them (``make_codec(name)`` with the constructor's defaults,
unless ``--powersgd-rank`` is given). ``allreduce`` does no codec work (its
averaging divide is part of DDP, in the floor's place too): its compute is 0.

``--retained-steps`` instead trains the workload's model on its own batches
(rank 0's) and, at each listed step, reports the share of that step's gradient
energy each codec keeps in one application, measured by the very code ``auto``'s
convergence gate runs (``AutoPolicy.measure_retained``; one bucket of all
gradients, in backward order) against the gate's bar, ``min_retained``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: python benchmarks/codec_cost.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import workloads  # noqa: E402

ALL_CODECS = ("allreduce", "bf16", "fp16", "powersgd", "topk", "sign")
"""Every codec ``auto`` can choose (slipstream.sync.compress.CODECS)."""


def _median_ms(fn: Callable[[Any], Any], setup: Callable[[], Any], repeats: int) -> float:
    """Median of ``repeats`` timed calls ``fn(setup())``; ``setup`` runs outside the timer."""
    times = []
    for _ in range(repeats):
        arg = setup()
        t0 = time.perf_counter()
        fn(arg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(workload: str | workloads.Workload, world_sizes: tuple[int, ...] = (2,),
            codecs: tuple[str, ...] = ALL_CODECS, repeats: int = 20, warmup: int = 3,
            codec_options: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Floor step, backward time and per-codec compute and wire bytes of ``workload``'s model.

    One process, one thread (restored after), no communication. Returns a JSON-able dict::

        {"workload", "threads": 1, "repeats", "numel", "grad_bytes",
         "floor_step_ms", "forward_ms", "backward_ms", "optimizer_ms",   # medians over ``repeats`` steps
         "codecs": {NAME: {"compute_ms", "collectives_per_step",
                           "wire_bytes_per_step": {"2": bytes per rank at n=2, ...}}}}

    ``compute_ms`` is the median time of one ``reduce`` of all the gradients (one flat
    buffer, the model's layout) on a one-rank wire; ``collectives_per_step`` the
    collectives that reduce launches (each pays the link's per-message latency).
    """
    import torch

    from slipstream.sync.compress import make_codec
    from slipstream.sync.compress.base import Wire, layout_from_shapes

    work = workloads.get(workload) if isinstance(workload, str) else workload
    options = codec_options or {}
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = work.build()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = work.optimizer(params)
        x, y = work.batch(0, 0)
        fw, bw, op, total = [], [], [], []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            loss = work.loss(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if i >= warmup:
                fw.append(t1 - t0)
                bw.append(t2 - t1)
                op.append(t3 - t2)
                total.append(t3 - t0)
        numel = sum(p.numel() for p in params)
        layout = layout_from_shapes([p.shape for p in params])
        grad = torch.randn(numel, generator=torch.Generator().manual_seed(0))

        class CountingWire(Wire):
            """A one-rank wire (no-op collectives) that counts the collectives a reduce launches."""

            def allreduce(self, t, op=None):
                self.collectives += 1
                return super().allreduce(t, op)

            def allgather(self, t):
                self.collectives += 1
                return super().allgather(t)

            def reduce_scatter(self, t):
                self.collectives += 1
                return super().reduce_scatter(t)

        out: dict[str, dict[str, Any]] = {}
        for name in codecs:
            codec = make_codec(name, **options.get(name, {}))
            if hasattr(codec, "track_signal"):
                codec.track_signal = False  # the guard's norms are computed on check steps only
            solo = CountingWire(None, size=1)
            codec.reduce(grad.clone(), solo, 0, layout)
            per_call = solo.collectives
            if name == "allreduce":
                compute_ms = 0.0
            else:
                for _ in range(2):
                    codec.reduce(grad.clone(), solo, 0, layout)
                compute_ms = _median_ms(lambda flat, c=codec, w=solo: c.reduce(flat, w, 0, layout), grad.clone,
                                        repeats)
            out[name] = {
                "compute_ms": compute_ms,
                "collectives_per_step": per_call,
                "wire_bytes_per_step": {str(n): float(codec.wire_bytes(numel, n, layout)) for n in world_sizes},
            }
    finally:
        torch.set_num_threads(old_threads)
    return {
        "workload": work.name, "threads": 1, "repeats": repeats, "numel": numel, "grad_bytes": numel * 4,
        "floor_step_ms": statistics.median(total) * 1e3, "forward_ms": statistics.median(fw) * 1e3,
        "backward_ms": statistics.median(bw) * 1e3, "optimizer_ms": statistics.median(op) * 1e3,
        "codecs": out,
    }


def retained(workload: str | workloads.Workload, steps: tuple[int, ...], codecs: tuple[str, ...] = ALL_CODECS,
             codec_options: dict[str, dict[str, Any]] | None = None) -> dict[int, dict[str, float]]:
    """Per listed step (1-based), per lossy codec: the share of that step's gradient energy one
    application keeps, as ``auto``'s convergence gate measures it. One thread, rank 0's batches."""
    import torch

    from slipstream.network.link import Link
    from slipstream.sync.accounting import StepRecord
    from slipstream.sync.auto import AutoPolicy
    from slipstream.sync.compress.base import layout_from_shapes
    from slipstream.sync.control import ControlWire
    from slipstream.sync.options import SyncOptions

    work = workloads.get(workload) if isinstance(workload, str) else workload
    link = Link.measured(ranks=1, alpha_s=0.0, bytes_per_s=1e9)  # the share does not depend on the link
    opts = SyncOptions(candidates=tuple(c for c in codecs if c != "allreduce"), codec_options=codec_options or {})
    policy = AutoPolicy(opts, ControlWire(None), world_size=1, link=link, prober=lambda: link)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[int, dict[str, float]] = {}
    try:
        model = work.build()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = work.optimizer(params)
        for step in range(1, max(steps) + 1):
            x, y = work.batch(step - 1, 0)
            opt.zero_grad(set_to_none=True)
            work.loss(model(x), y).backward()
            if step in steps:
                grads = [p.grad for p in params if p.grad is not None][::-1]  # DDP's backward order
                record = StepRecord(t_backward_start=None)
                key = tuple(range(len(grads)))
                record.numel[0], record.keys[0] = sum(g.numel() for g in grads), key
                record.outputs[0] = torch.cat([g.reshape(-1) for g in grads])
                layouts = {key: layout_from_shapes([g.shape for g in grads])}
                out[step] = policy.measure_retained([0], record, torch.device("cpu"), layouts)
            opt.step()
    finally:
        torch.set_num_threads(old_threads)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mlp", help="mlp, gpt or resnet (benchmarks/workloads.py)")
    ap.add_argument("--codecs", default="powersgd,sign,topk,bf16", help="comma list, or 'all'")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--world-sizes", default="2", help="comma list of n for the wire bytes")
    ap.add_argument("--powersgd-rank", type=int, default=None,
                    help="PowerSGD rank (default: the codec's own default, which auto uses)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures (measure()'s dict) to PATH")
    ap.add_argument("--retained-steps", metavar="STEPS",
                    help="comma list of steps: report each codec's retained share of the gradient there instead")
    args = ap.parse_args(argv)
    codecs = ALL_CODECS if args.codecs == "all" else tuple(c for c in args.codecs.split(",") if c)
    options = {"powersgd": {"rank": args.powersgd_rank}} if args.powersgd_rank is not None else {}
    if args.retained_steps:
        from slipstream.sync.options import DEFAULTS

        try:
            steps = tuple(int(s) for s in args.retained_steps.split(",") if s)
        except ValueError:
            ap.error(f"--retained-steps takes a comma list of step numbers, got {args.retained_steps!r}")
        if not steps or min(steps) < 1:
            ap.error("--retained-steps: steps count from 1")
        shares = retained(args.workload, steps, codecs, options)
        print(f"{args.workload}: share of each step's gradient energy one application keeps "
              f"(auto's gate leaves out a codec under {DEFAULTS.min_retained:.2f})")
        for step, row in shares.items():
            print(f"step {step:3d}: " + "  ".join(f"{name} {v:.3f}" for name, v in row.items()))
        return 0
    ns = tuple(int(n) for n in args.world_sizes.split(",") if n)
    fig = measure(args.workload, ns, codecs, repeats=args.repeats, codec_options=options)
    floor = fig["floor_step_ms"]
    print(f"{fig['workload']}: {fig['grad_bytes'] / 1e6:.1f} MB of gradients; floor step (forward + backward + "
          f"optimizer): {floor:.1f} ms, of which backward {fig['backward_ms']:.1f} ms")
    for name, c in fig["codecs"].items():
        wire = ", ".join(f"n={n}: {b / 1e6:.2f} MB" for n, b in c["wire_bytes_per_step"].items())
        print(f"{name:10s} {c['compute_ms']:6.1f} ms per step ({c['compute_ms'] / floor:.2f}x the floor step); "
              f"{c['collectives_per_step']} collectives; wire per rank {wire}")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
