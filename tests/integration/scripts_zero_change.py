"""One model, one data stream, two ways: a plain DDP loop (--mode ddp, the script a user
already has) or slipstream.accelerate() (--mode accelerate). Under `slipstream run --sync bf16`
the first must end bitwise equal to the second with sync="bf16" (tests/integration/test_zero_change.py).

--hang-at STEP: rank 1 sleeps before that step's forward (the hang report's test).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=("ddp", "accelerate"), default="ddp")
p.add_argument("--sync", default=None, help="--mode accelerate: accelerate(sync=...)")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--hang-at", type=int, default=None)
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
if args.mode == "accelerate":
    import slipstream

    run = slipstream.accelerate(net, opt, sync=args.sync)
    model = run.model
else:
    model = DDP(net)
losses = []
for step in range(args.steps):
    g = torch.Generator().manual_seed(step * 10 + rank)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)
    if args.hang_at is not None and step == args.hang_at and rank == 1:
        time.sleep(600)
    if args.mode == "accelerate":
        loss = F.cross_entropy(model(x), y)
        run.backward(loss)
        run.step()
    else:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    losses.append(loss.item())
if args.mode == "accelerate":
    run.finish()
if rank == 0:
    torch.save(net.state_dict(), os.path.join(args.out, "model.pt"))
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump({"losses": losses}, f)
dist.barrier()
dist.destroy_process_group()
