"""Train a ResNet-18-style CNN on generated images.

The data is made here, so nothing is downloaded: each of 10 classes is a fixed
random 3x32x32 pattern, and a sample is its class pattern under noise, shifted
by a few pixels. A CNN learns it in a few hundred steps; the noise keeps it
from being trivial.

    python examples/train_resnet.py --steps 50
    slipstream run -n 2 --precision bf16 examples/train_resnet.py --steps 200

The changes that make a plain script a Slipstream one are marked "# slipstream".
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import slipstream  # slipstream
from slipstream.names import renamed_flag  # slipstream


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18's layout (4 stages of 2 basic blocks) with a width you choose."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, c_in = [], width
        for i, c_out in enumerate([width, 2 * width, 4 * width, 8 * width]):
            for j in range(2):
                layers.append(BasicBlock(c_in, c_out, stride=2 if (j == 0 and i > 0) else 1))
                c_in = c_out
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def make_batch(step: int, rank: int, batch: int, seed: int, noise: float = 1.0):
    """A pure function of (seed, step, rank): resumed runs see the same samples."""
    templates = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank + 1)
    labels = torch.randint(0, 10, (batch,), generator=g)
    shifts = torch.randint(-3, 4, (batch, 2), generator=g)
    images = torch.stack([torch.roll(templates[c], tuple(s.tolist()), dims=(1, 2)) for c, s in zip(labels, shifts)])
    return images + noise * torch.randn(images.shape, generator=g), labels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for the final model's state_dict")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here; resume from the newest complete one")
    p.add_argument("--checkpoint-every-steps", type=int, default=None, help="save every N optimizer steps")
    p.add_argument("--checkpoint-every", type=int, default=None, help=argparse.SUPPRESS)  # the old name, until 0.2
    args = p.parse_args()
    args.checkpoint_every_steps = renamed_flag(args.checkpoint_every_steps, args.checkpoint_every, "--checkpoint-every")
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be >= 1")

    rt = slipstream.init()  # slipstream
    torch.manual_seed(args.seed)
    model = ResNet18(width=args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    run = slipstream.accelerate(  # slipstream
        model, optimizer, total_steps=args.steps,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every_steps=args.checkpoint_every_steps,
    )
    if rt.is_main:
        params = sum(p.numel() for p in model.parameters())
        print(f"ResNet-18 (width {args.width}): {params / 1e6:.2f}M parameters, {rt.world_size} rank(s) on {rt.device}")

    started = time.perf_counter()
    correct = seen = 0
    while run.step_count < args.steps:  # restored from a checkpoint on resume
        x, y = make_batch(run.micro_step_count, rt.rank, args.batch_size, args.seed)
        x, y = x.to(rt.device), y.to(rt.device)
        logits = run.model(x)
        loss = F.cross_entropy(logits, y)
        run.backward(loss)  # slipstream
        if run.step_count >= args.steps - 10:  # accuracy over the last 10 steps
            correct += (logits.argmax(1) == y).sum().item()
            seen += y.numel()
        if run.step().stop_requested:  # slipstream: SIGTERM (preemption); the checkpoint of this step is written
            break
    step = run.step_count

    summary = run.finish()
    if run.stop_requested:  # exit 143: the launcher (and Kubernetes) count it as a preemption, not a failure
        slipstream.shutdown(exit_code=slipstream.EXIT_PREEMPTED)
    if rt.is_main:
        print(f"done: {step} steps in {time.perf_counter() - started:.1f} s, final loss {summary['final_loss']:.4f}, "
              f"train accuracy (last 10 steps, rank 0) {correct / max(1, seen):.2%}, "
              f"{summary['samples_per_s'] or 0:.0f} images/s on {rt.world_size} rank(s)")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save(run.unwrapped_state_dict(), os.path.join(args.out, "model.pt"))
            print(f"saved {os.path.join(args.out, 'model.pt')}")
    # Ends the process here: torch's gloo can abort in interpreter teardown (see shutdown's docstring).
    slipstream.shutdown(exit_code=0)


if __name__ == "__main__":
    main()
