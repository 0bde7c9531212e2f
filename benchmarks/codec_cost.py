"""Compute time of each gradient codec on the guide's MLP, one core, no communication.

    python benchmarks/codec_cost.py [--codecs powersgd,sign,topk,bf16] [--repeats 20]

Prints, per codec, the median time of one ``reduce`` on a one-rank wire of all 33.6 MB of the MLP's
gradients (layout-aware, warm-start state after three untimed calls), next to
the floor step (forward + backward + SGD) of the same model in the same process.
With one core per rank this time adds to every compressed step. Run it on a
quiet machine; to compare two commits, run it at each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from sync_mlp import build_model  # the guide's MLP


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", default="powersgd,sign,topk,bf16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--powersgd-rank", type=int, default=2, help="rank 2 is what auto's default PowerSGD uses here")
    args = ap.parse_args()
    from slipstream.sync.compress import layout_from_shapes, make_codec
    from slipstream.sync.compress.base import Wire

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))

    def floor_step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        floor_step()
    floor = _median_ms(floor_step, args.repeats)
    layout = layout_from_shapes([p.shape for p in model.parameters()])
    flat = torch.randn(sum(p.numel() for p in model.parameters()))
    print(f"floor step (forward + backward + SGD): {floor:.1f} ms")
    for name in args.codecs.split(","):
        codec = make_codec(name, rank=args.powersgd_rank) if name == "powersgd" else make_codec(name)
        if hasattr(codec, "track_signal"):
            codec.track_signal = False  # the guard's norms are computed on check steps only
        solo = Wire(None, size=1)  # one rank: the codec's arithmetic, no-op collectives
        for _ in range(3):
            codec.reduce(flat, solo, 0, layout)
        ms = _median_ms(lambda c=codec, w=solo: c.reduce(flat, w, 0, layout), args.repeats)
        print(f"{name:10s} {ms:6.1f} ms per step ({ms / floor:.2f}x the floor step)")


if __name__ == "__main__":
    main()
