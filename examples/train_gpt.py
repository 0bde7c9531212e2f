"""Train a small GPT on the Python standard library's own source code.

Every machine with Python has this corpus, so the example needs no download.
Tokens are bytes (vocabulary 256), which keeps the example free of a tokenizer.

    python examples/train_gpt.py --steps 50                 # one process
    slipstream run -n 2 examples/train_gpt.py --steps 200   # two, data parallel
    slipstream run -n 4 --dp-shard 2 --tp 2 examples/train_gpt.py   # FSDP2 x tensor parallel
    slipstream run -n 2 --pp 2 examples/train_gpt.py        # two pipeline stages
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


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v/out projections, so tensor
    parallelism can shard q, k, v by columns (whole heads per rank) and out by rows."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads  # slipstream checks that tp divides it
        self.head_dim = dim // heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Heads from the width q actually has: dim / tp columns when q is sharded over tp ranks.
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 128, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        # A ModuleDict, not a ModuleList: a pipeline stage deletes the blocks it does
        # not run and the others keep their names (blocks.3 stays blocks.3).
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads) for i in range(layers)})
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        for module in self.modules():  # GPT-2's small init keeps the first logits near uniform
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Under pipeline parallelism a stage holds some of these modules only (the
        # others are None) and x is the previous stage's output.
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.ln is not None:
            x = self.ln(x)
        return self.head(x) if self.head is not None else x


# How tensor parallelism shards each block (Megatron-LM's split): q/k/v by
# columns (each rank gets whole heads), out by rows, then one all-reduce; the
# MLP likewise. Embeddings, norms and the head stay replicated.
TP_PLAN = {
    "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
    "blocks.*.attn.out": "rowwise",
    "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise",
}


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


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
    p.add_argument("--batch-size", type=int, default=16, help="sequences per data-parallel rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--out", default=None, help="directory for the final model's state_dict")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here; resume from the newest complete one")
    p.add_argument("--checkpoint-every", type=int, default=None, help="save every N optimizer steps")
    # Parallel layout (default: data parallel over every rank; `slipstream run --tp 2 ...` sets these too).
    p.add_argument("--dp-shard", type=int, default=None, help="FSDP2 over this many ranks")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel degree")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (split between blocks)")
    args = p.parse_args()
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be >= 1")

    rt = slipstream.init()  # slipstream: process group, device (NCCL on GPUs, gloo on CPUs)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    corpus = load_corpus(int(args.corpus_mb * 2**20))
    model = GPT(dim=args.dim, layers=args.layers, context=args.context)
    params = sum(p.numel() for p in model.parameters())
    warmup = max(1, args.steps // 20)
    # Factories rather than objects: sharded, tensor-parallel and pipeline layouts
    # replace the parameters, and the optimizer must hold the new ones.
    run = slipstream.accelerate(  # slipstream
        model,
        lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
        scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))
        ),
        total_steps=args.steps, checkpoint_dir=args.checkpoint_dir, checkpoint_every_steps=args.checkpoint_every,
        dp_shard=args.dp_shard, tp=args.tp, pp=args.pp, tp_plan=TP_PLAN,
    )
    if rt.is_main:
        c = run.config
        print(f"GPT: {params / 1e6:.2f}M parameters, corpus {corpus.numel() / 2**20:.1f} MiB, "
              f"{rt.world_size} rank(s) on {rt.device}, precision {c.numerics.precision}, sync {c.sync.strategy}, "
              f"layout {run.describe_layout()}")

    started = time.perf_counter()
    # run.step_count and run.micro_step_count come back from a checkpoint on
    # resume, so the loop and the data continue where they stopped.
    # Ranks of one tensor-parallel group or one pipeline read the same batch: index by run.dp_rank.
    while run.step_count < args.steps:
        x, y = batch_for(run.micro_step_count, run.dp_rank, corpus, args.batch_size, args.context, args.seed)
        x, y = x.to(rt.device), y.to(rt.device)
        # slipstream (was: loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()).
        # Without pipeline stages, run.model(x) / run.backward(loss) / run.step() work as well.
        run.train_step(x, y, loss_fn)
        if run.stop_requested:  # SIGTERM (preemption): the checkpoint of this step is written
            break
    step = run.step_count

    summary = run.finish()
    if run.stop_requested:  # exit 143: the launcher (and Kubernetes) count it as a preemption, not a failure
        slipstream.shutdown(exit_code=slipstream.EXIT_PREEMPTED)
    # Gathering a sharded model is a collective: every rank asks, the first one writes.
    state = run.unwrapped_state_dict() if args.out else None
    if rt.is_main:
        elapsed = time.perf_counter() - started
        print(f"done: {step} steps in {elapsed:.1f} s, final loss {summary['final_loss']:.4f} "
              f"(uniform guess: {math.log(256):.4f}), {summary['tokens_per_s'] or 0:.0f} tokens/s on {rt.world_size} rank(s)")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save(state, os.path.join(args.out, "model.pt"))
            print(f"saved {os.path.join(args.out, 'model.pt')}")
    # Ends the process here: torch's gloo can abort in interpreter teardown (see shutdown's docstring).
    slipstream.shutdown(exit_code=0)


if __name__ == "__main__":
    main()
