"""Train a small GPT on the Python standard library's own source code.

Every machine with Python has this corpus, so the example needs no download.
Tokens are bytes (vocabulary 256), which keeps the example free of a tokenizer.

    python examples/train_gpt.py --steps 50                 # one process
    slipstream run -n 2 examples/train_gpt.py --steps 200   # two, data parallel
    torchrun --nproc-per-node 2 examples/train_gpt.py       # also works

The changes that make a plain script a Slipstream one are marked "# slipstream".
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import slipstream  # slipstream


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The stdlib's .py files, sorted by path so every rank and run sees the same bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1), persistent=False)
        for module in self.modules():  # GPT-2's small init keeps the first logits near uniform
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        return self.head(self.ln(x))


def batch_for(step: int, rank: int, corpus: torch.Tensor, batch: int, context: int, seed: int):
    """Random windows, a pure function of (seed, step, rank): a resumed run sees the same data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, corpus.numel() - context - 1, (batch,), generator=g)
    x = torch.stack([corpus[s : s + context] for s in starts])
    y = torch.stack([corpus[s + 1 : s + context + 1] for s in starts])
    return x, y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--out", default=None, help="directory for the final model's state_dict")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here; resume from the newest complete one")
    p.add_argument("--checkpoint-every", type=int, default=None, help="save every N optimizer steps")
    args = p.parse_args()
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be >= 1")

    rt = slipstream.init()  # slipstream: process group, device (NCCL on GPUs, gloo on CPUs)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    corpus = load_corpus(int(args.corpus_mb * 2**20))
    model = GPT(dim=args.dim, layers=args.layers, context=args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
    )
    run = slipstream.accelerate(  # slipstream
        model, optimizer, scheduler=schedule, total_steps=args.steps,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every_steps=args.checkpoint_every,
    )
    if rt.is_main:
        params = sum(p.numel() for p in model.parameters())
        print(f"GPT: {params / 1e6:.2f}M parameters, corpus {corpus.numel() / 2**20:.1f} MiB, "
              f"{rt.world_size} rank(s) on {rt.device}, precision {run.config.precision}, sync {run.config.sync}")

    started = time.perf_counter()
    # run.step_count and run.micro_step_count come back from a checkpoint on
    # resume, so the loop and the data continue where they stopped.
    while run.step_count < args.steps:
        x, y = batch_for(run.micro_step_count, rt.rank, corpus, args.batch_size, args.context, args.seed)
        x, y = x.to(rt.device), y.to(rt.device)
        logits = run.model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        run.backward(loss)  # slipstream (was: loss.backward())
        run.step()  # slipstream (was: optimizer.step(); optimizer.zero_grad())
    step = run.step_count

    summary = run.finish()
    if rt.is_main:
        elapsed = time.perf_counter() - started
        print(f"done: {step} steps in {elapsed:.1f} s, final loss {summary['final_loss']:.4f} "
              f"(uniform guess: {math.log(256):.4f}), {summary['tokens_per_s'] or 0:.0f} tokens/s on {rt.world_size} rank(s)")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save(run.unwrapped_state_dict(), os.path.join(args.out, "model.pt"))
            print(f"saved {os.path.join(args.out, 'model.pt')}")
    slipstream.shutdown()


if __name__ == "__main__":
    main()
