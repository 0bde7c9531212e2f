"""An unmodified torchrun DDP script: it must give the same result under torchrun and slipstream run."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(20):
    g = torch.Generator().manual_seed(step * 10 + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
if rank == 0:
    torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))
dist.barrier()  # leave together: gloo torn down under a live peer can abort at exit
dist.destroy_process_group()
