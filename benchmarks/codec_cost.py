"""Compute time of each gradient codec on a workload's model, one core, no communication.

    python benchmarks/codec_cost.py [--workload mlp] [--codecs powersgd,sign,topk,bf16] [--repeats 20]
    python -m benchmarks.codec_cost --workload gpt --world-sizes 2,4 --json figures.json

Prints, per codec, the median time of one ``reduce`` on a one-rank wire of all
the model's gradients (layout-aware, warm-start state after three untimed calls,
a fresh copy of the same random gradient each call), next to the floor step
(forward + backward + optimizer) of the same model in the same process, and the
codec's wire bytes per rank and step at each world size n (the codec's own
accounting, ``Codec.wire_bytes``: ring formulas of ``slipstream.link``, e.g.
2(n-1)/n * S for an all-reduce of S bytes). With one core per rank this time
adds to every compressed step. Run it on a quiet machine; to compare two
commits, run it at each.

:func:`measure` is the reusable part: ``benchmarks.run`` calls it (through this
CLI, ``--json``) once per workload, and ``benchmarks.report.machine_limit``
turns its figures into the machine limit of each table cell. Codecs are built
as ``auto`` builds them (``make_codec(name)`` with the constructor's defaults,
unless ``--powersgd-rank`` is given). ``allreduce`` does no codec work (its
averaging divide is part of DDP, in the floor's place too): its compute is 0.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="mlp", help="mlp, gpt or resnet (benchmarks/workloads.py)")
    ap.add_argument("--codecs", default="powersgd,sign,topk,bf16", help="comma list, or 'all'")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--world-sizes", default="2", help="comma list of n for the wire bytes")
    ap.add_argument("--powersgd-rank", type=int, default=None,
                    help="PowerSGD rank (default: the codec's own default, which auto uses)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures (measure()'s dict) to PATH")
    args = ap.parse_args(argv)
    codecs = ALL_CODECS if args.codecs == "all" else tuple(c for c in args.codecs.split(",") if c)
    options = {"powersgd": {"rank": args.powersgd_rank}} if args.powersgd_rank is not None else {}
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
