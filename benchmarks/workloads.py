"""Training workloads for the side-by-side benchmark: model, data and optimizer.

Each workload is a pure recipe: ``build()`` gives a freshly initialised model
(same weights on every rank for one seed), ``batch(step, rank)`` a batch that is
a pure function of (step, rank), so every system sees exactly the same data.

* ``mlp``: the communication-heavy MLP of docs/measuring.md (8 x Linear(1024,
  1024)+ReLU, Linear(1024, 10); 8.4M parameters, 33.6 MB of fp32 gradients;
  batch 64; SGD lr 0.01). docs/measuring.md trains it on random labels, which no model
  can learn, so a loss target would be meaningless: here each sample is one of
  10 fixed random class templates under Gaussian noise (std 3), scaled to unit
  variance, which the MLP learns steadily (He init; see build()): the loss falls
  from 2.30 to about 1.7 in 60 steps. Step time is unchanged.
* ``gpt``: the model and data of examples/train_gpt.py (bytes of the Python
  standard library), AdamW at a constant lr.
* ``resnet``: the model and data of examples/train_resnet.py, SGD + momentum.

The GPT and ResNet workloads import the example files, so they measure the
same model a user runs; they are skipped with a clear message if missing.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Workload:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: Callable[[list], torch.optim.Optimizer]
    samples_per_batch: int


def _example(name: str):
    path = ROOT / "examples" / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"workload needs {path}, which is missing")
    spec = importlib.util.spec_from_file_location(f"_bench_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def mlp(batch_size: int = 64, dim: int = 1024, depth: int = 8, noise: float = 3.0, seed: int = 0) -> Workload:
    templates = torch.randn(10, dim, generator=torch.Generator().manual_seed(seed + 7))

    def build() -> nn.Module:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(dim, dim), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(dim, 10))
        # He init keeps the signal alive through 8 ReLU layers (torch's default
        # shrinks it ~40x, and the net then barely learns in 100 steps); a small
        # last layer starts the loss near ln(10) instead of far above it.
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
        nn.init.normal_(model[-1].weight, std=0.01)
        return model

    def batch(step: int, rank: int):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
        y = torch.randint(0, 10, (batch_size,), generator=g)
        # Unit variance per feature: with He init, raw inputs of std ~3 make the first SGD step
        # overshoot (loss 2.3 -> 8); normalised, the loss falls smoothly from ln(10).
        x = (templates[y] + noise * torch.randn(batch_size, dim, generator=g)) / math.sqrt(1 + noise**2)
        return x, y

    return Workload("mlp", build, batch, F.cross_entropy,
                    lambda params: torch.optim.SGD(params, lr=0.01), batch_size)


def gpt(batch_size: int = 16, context: int = 64, dim: int = 128, layers: int = 4, seed: int = 0) -> Workload:
    ex = _example("train_gpt")
    corpus = ex.load_corpus(int(1.0 * 2**20))

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return ex.GPT(dim=dim, layers=layers, context=context)

    def batch(step: int, rank: int):
        return ex.batch_for(step, rank, corpus, batch_size, context, seed)

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    return Workload("gpt", build, batch, loss,
                    lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01), batch_size)


def resnet(batch_size: int = 32, width: int = 16, seed: int = 0) -> Workload:
    ex = _example("train_resnet")

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return ex.ResNet18(width=width)

    def batch(step: int, rank: int):
        return ex.make_batch(step, rank, batch_size, seed)

    return Workload("resnet", build, batch, F.cross_entropy,
                    lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), batch_size)


WORKLOADS: dict[str, Callable[[], Workload]] = {"mlp": mlp, "gpt": gpt, "resnet": resnet}


def get(name: str) -> Workload:
    if name not in WORKLOADS:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]()


def grad_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


if __name__ == "__main__":  # quick look: python -m benchmarks.workloads
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for name in WORKLOADS:
        w = get(name)
        m = w.build()
        print(f"{name}: {sum(p.numel() for p in m.parameters()) / 1e6:.2f}M params, {grad_bytes(m) / 1e6:.1f} MB grads")
