"""Fit a small regression network with Hugging Face Accelerate: a plain Accelerate script, nothing of Slipstream in it.

    python examples/accelerate_ddp.py                                      # one process
    torchrun --standalone --nproc_per_node 2 examples/accelerate_ddp.py    # two, data parallel (DDP, gloo)
    slipstream run -n 2 examples/accelerate_ddp.py                         # the same line under Slipstream

--out DIR writes rank 0's final weights (DIR/model.pt) and final loss (DIR/result.json).
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.nn import functional as F

FEATURES = 16


def make_dataset(size: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    """A smooth nonlinear target plus noise: the same on every rank and run (a seeded generator)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g) / FEATURES**0.5
    y = torch.sin(x @ w) + 0.1 * x[:, :1] ** 2 + 0.05 * torch.randn(size, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", help="directory for model.pt and result.json (rank 0)")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(make_dataset(8192), batch_size=64, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # DDP, and a shard of the data per rank

    model.train()
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 10 == 0 or step == args.steps:
                mean_loss = accelerator.reduce(loss.detach(), reduction="mean").item()
                accelerator.print(f"step {step}: loss {mean_loss:.4f}")
            if step == args.steps:
                break

    if args.out and accelerator.is_main_process:
        os.makedirs(args.out, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in accelerator.unwrap_model(model).state_dict().items()}
        torch.save(state, os.path.join(args.out, "model.pt"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"loss": mean_loss, "steps": step, "world_size": accelerator.num_processes}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
