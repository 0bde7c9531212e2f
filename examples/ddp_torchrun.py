"""A plain PyTorch DDP script, as a torchrun tutorial writes it: no Slipstream in it.

An MLP learns a fixed random teacher network from generated inputs (nothing is
downloaded). It runs unchanged under

    torchrun --standalone --nproc_per_node 2 examples/ddp_torchrun.py --steps 50
    slipstream run -n 2 examples/ddp_torchrun.py --steps 50
    slipstream run -n 2 --sync auto examples/ddp_torchrun.py --steps 50     # Slipstream's gradient sync

and alone (``python examples/ddp_torchrun.py``: one process). With ``--sync``,
slipstream run installs the strategy on the DDP model built below
(docs/zero-change.md). ``--out DIR`` writes rank 0's final weights
(``model.pt``) and losses (``result.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def mlp(width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)  # `python examples/ddp_torchrun.py`: one process, no launcher
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    teacher = mlp(64, 2).to(device)
    model = DDP(mlp(args.width, args.depth).to(device), device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(args.batch, 64, generator=g).to(device)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f}", flush=True)
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"final loss {losses[-1]:.4f} after {args.steps} steps in {elapsed:.1f} s", flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))
            with open(os.path.join(args.out, "result.json"), "w") as f:
                json.dump({"loss": losses[-1], "final_loss": losses[-1], "losses": losses, "steps": args.steps,
                           "world_size": world, "train_s": elapsed}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
