"""Do two checkouts give the same bits? Every sync strategy, 2 gloo ranks, a few steps.

Run it once per checkout (``PYTHONPATH=OTHER/src`` picks the other one) and
compare the two outputs; a refactor of the sync engine must keep every
strategy's final parameters bitwise equal::

    PYTHONPATH=/tmp/old/src python -m benchmarks.sync_parity --out old.pt
    python -m benchmarks.sync_parity --out new.pt
    python -m benchmarks.sync_parity --compare old.pt new.pt
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys

import torch

STRATEGIES = {
    "allreduce": {}, "bf16": {}, "fp16": {}, "powersgd": {"rank": 2}, "topk": {"density": 0.05}, "sign": {},
    "hierarchical": {}, "hierarchical+powersgd": {"rank": 2}, "hierarchical+topk": {"density": 0.05},
    "hierarchical+sign": {},
}
WIDTHS = (32, 64, 64, 8)


def _train(name: str, options: dict, steps: int) -> tuple[str, float]:
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from slipstream import sync

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers[:-1])
    ddp = DDP(model, bucket_cap_mb=0.005)  # several buckets: the ordering matters
    state = sync.apply(name, ddp, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    teacher = torch.randn(WIDTHS[0], WIDTHS[-1], generator=torch.Generator().manual_seed(12345))
    loss = torch.zeros(())
    for step in range(steps):
        x = torch.randn(16, WIDTHS[0], generator=torch.Generator().manual_seed(1000 * step + dist.get_rank()))
        loss = nn.functional.cross_entropy(ddp(x), (x @ teacher).argmax(dim=1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if hasattr(state, "close"):
        state.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return digest, float(loss)


def _worker(rank: int, port: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {name: _train(name, options, steps) for name, options in STRATEGIES.items()}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write this checkout's digests here")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two outputs")
    args = parser.parse_args(argv)
    if args.compare:
        a, b = (torch.load(p) for p in args.compare)
        differ = [name for name in a if a[name][0] != b.get(name, (None,))[0]]
        for name in a:
            print(f"{name:24s} {'same bits' if name not in differ else 'DIFFERENT'}  "
                  f"loss {a[name][1]:.6f} / {b.get(name, (None, float('nan')))[1]:.6f}")
        return 1 if differ else 0
    if not args.out:
        parser.error("give --out FILE or --compare A B")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args.steps, args.out), nprocs=2, join=True)
    import slipstream

    print(f"wrote {args.out} ({len(STRATEGIES)} strategies, {args.steps} steps, slipstream from {slipstream.__file__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
