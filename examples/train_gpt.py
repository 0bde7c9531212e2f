"""Train a small GPT on the Python standard library's own source code.

Every machine with Python has this corpus, so the example needs no download.
Tokens are bytes (and an end-of-text token between files: vocabulary 257),
which keeps the example free of a tokenizer. The first run packs the corpus
into token shards under ~/.cache/slipstream/gpt_corpus (once; later runs and
the other ranks read them), and training reads them through slipstream.data:
a resumable sampler whose position is saved in every checkpoint, a prefetch
thread, and the data wait in the metrics. `--data DIR|URL` trains on another
packed dataset (`slipstream data pack ... --tokens-per-sample CONTEXT+1`).

    python examples/train_gpt.py --steps 50                 # one process
    slipstream run -n 2 examples/train_gpt.py --steps 200   # two, data parallel
    slipstream run -n 4 --dp-shard 2 --tp 2 examples/train_gpt.py   # FSDP2 x tensor parallel
    slipstream run -n 2 --pp 2 examples/train_gpt.py        # two pipeline stages
    torchrun --nproc-per-node 2 examples/train_gpt.py       # also works

The changes that make a plain script a Slipstream one are marked "# slipstream".
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import slipstream  # slipstream
from slipstream.names import renamed_flag  # slipstream
from slipstream.data import ShardedDataset, SlipstreamLoader, pack_text  # slipstream


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The stdlib's .py files as one byte tensor, sorted by path (for benchmarks that train in one process)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "site-packages"}
    found: list[Path] = []
    if not skip & set(root.parts):
        # os.walk, pruned: a glob over the stdlib walks all of site-packages before a filter
        # drops it (1-2.5 s per call; the GPU acceptance run loads the corpus 64 times).
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip]
            found += [Path(dirpath, f) for f in filenames if f.endswith(".py")]
    chunks, total = [], 0
    for path in sorted(found):
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


def stdlib_corpus_shards(cache_dir: str, corpus_mb: float, context: int, local_rank: int) -> str:
    """The stdlib's .py files as packed token shards of context + 1 tokens, made once per cache.

    Local rank 0 packs (the caller's barrier holds the others back). It packs into a
    temporary directory beside the final one and renames it into place, so two jobs
    packing at once both end with one complete dataset, and a pack that dies leaves
    nothing that looks finished.
    """
    key = f"py{sys.version_info.major}.{sys.version_info.minor}-{corpus_mb:g}mb-{context + 1}tok"
    path = os.path.join(cache_dir, "gpt_corpus", key)
    if local_rank != 0 or os.path.exists(os.path.join(path, "index.json")):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{key}.", dir=os.path.dirname(path))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep a shared cache from other users
        pack_text(sysconfig.get_paths()["stdlib"], tmp, tokens_per_sample=context + 1, suffixes=(".py",),
                  exclude_dirs=("site-packages", "test", "tests"), max_bytes=int(corpus_mb * 2**20))
        try:
            os.rename(tmp, path)
        except OSError:  # another job renamed its copy first: use that one
            if not os.path.exists(os.path.join(path, "index.json")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


class DataPosition:
    """The loader's place in the data, as checkpoint state (``extra_state``).

    accelerate() restores a checkpoint before the loader exists (the loader's rank
    split comes from the layout accelerate builds), so a restored state waits here
    until ``attach``. Before that, ``state_dict`` is a fresh loader's: the shape the
    checkpoint is read into.
    """

    def __init__(self, template: dict) -> None:
        self.loader: SlipstreamLoader | None = None
        self.restored: dict | None = None
        self.template = template

    def attach(self, loader: SlipstreamLoader) -> None:
        self.loader = loader
        if self.restored is not None:
            loader.load_state_dict(self.restored)

    def state_dict(self) -> dict:
        return self.loader.state_dict() if self.loader is not None else dict(self.restored or self.template)

    def load_state_dict(self, state: dict) -> None:
        self.restored = dict(state)
        if self.loader is not None:  # a restore while training (slipstream run --heal): the loop rewinds
            self.loader.load_state_dict(self.restored)
        if self.loader is not None:
            self.loader.load_state_dict(self.restored)


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
    p.add_argument("--corpus-mb", type=float, default=4.0, help="MiB of the stdlib corpus to pack (without --data)")
    p.add_argument("--data", default=None, metavar="DIR|URL",
                   help="a packed token dataset (slipstream data pack) to train on instead of the stdlib corpus")
    p.add_argument("--data-cache", default=os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "slipstream"),
                   metavar="DIR", help="where the packed stdlib corpus and shards read from URLs are kept")
    p.add_argument("--out", default=None, help="directory for the final model's state_dict")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here; resume from the newest complete one")
    p.add_argument("--checkpoint-every-steps", type=int, default=None, help="save every N optimizer steps")
    p.add_argument("--checkpoint-every", type=int, default=None, help=argparse.SUPPRESS)  # the old name, until 0.2
    # Parallel layout (default: data parallel over every rank; `slipstream run --tp 2 ...` sets these too).
    p.add_argument("--dp-shard", type=int, default=None, help="FSDP2 over this many ranks")
    p.add_argument("--tp", type=int, default=None, help="tensor parallel degree")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (split between blocks)")
    args = p.parse_args()
    args.checkpoint_every_steps = renamed_flag(args.checkpoint_every_steps, args.checkpoint_every, "--checkpoint-every")
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be >= 1")

    rt = slipstream.init()  # slipstream: process group, device (NCCL on GPUs, gloo on CPUs)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    data = args.data or stdlib_corpus_shards(args.data_cache, args.corpus_mb, args.context, rt.local_rank)
    if rt.world_size > 1:
        torch.distributed.barrier()  # the other ranks wait for local rank 0's first pack
    # slipstream: a URL is read through a node-local cache of verified shards; a local directory in place.
    dataset = ShardedDataset(data, cache=None if "://" not in data else os.path.join(args.data_cache, "shards"))
    (field,) = dataset.index.fields or (None,)
    vocab = dataset.index.meta.get("vocab_size")
    if field is None or len(field.shape) != 1 or field.shape[0] < args.context + 1 or vocab is None:
        raise slipstream.ConfigError(f"--data {data}: needs token samples of at least context + 1 = {args.context + 1} "
                                     f"tokens and meta.vocab_size in its index (fields {dataset.index.fields}, "
                                     f"vocab_size {vocab}); pack with --tokens-per-sample {args.context + 1}")
    loader_options = dict(batch_size=args.batch_size, seed=args.seed, drop_last=True)
    position = DataPosition(SlipstreamLoader(dataset, rank=0, world_size=1, prefetch_batches=0, **loader_options).state_dict())
    model = GPT(vocab=int(vocab), dim=args.dim, layers=args.layers, context=args.context)
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
        total_steps=args.steps, checkpoint_dir=args.checkpoint_dir, checkpoint_every_steps=args.checkpoint_every_steps,
        dp_shard=args.dp_shard, tp=args.tp, pp=args.pp, tp_plan=TP_PLAN,
        # The data position is saved with the model, so a resumed run reads the batches it would have read;
        # healing in place (on by default under `slipstream run`) keeps it in memory without a checkpoint_dir.
        extra_state={"data": position} if args.checkpoint_dir or rt.healer is not None else None,
    )
    # Ranks of one tensor-parallel group or one pipeline read the same batch: split the data by run.dp_rank.
    loader = SlipstreamLoader(dataset, rank=run.dp_rank, world_size=run.dp_size, **loader_options)  # slipstream
    position.attach(loader)
    run.recorder.sources.append(loader.stats)  # data_wait_s_total, data_batches_total in every metrics record
    if rt.is_main:
        c = run.config
        print(f"GPT: {params / 1e6:.2f}M parameters, data {data} ({len(dataset)} samples of {field.shape[0]} tokens), "
              f"{rt.world_size} rank(s) on {rt.device}, precision {c.numerics.precision}, sync {c.sync.strategy}, "
              f"layout {run.describe_layout()}")
        print(f"run directory: {run.recorder.run_dir} (metrics; at the end: slipstream report {run.recorder.run_dir})")

    started = time.perf_counter()
    # run.step_count comes back from a checkpoint on resume, and the loader's position
    # with it, so the loop and the data continue where they stopped.
    batches = (batch for _epoch in itertools.count() for batch in loader)  # each pass is one epoch
    while run.step_count < args.steps:
        tokens = next(batches)[:, : args.context + 1].long()  # the wait here is the step's data_wait_s
        x, y = tokens[:, :-1].to(rt.device), tokens[:, 1:].to(rt.device)
        # slipstream (was: loss = loss_fn(model(x), y); loss.backward(); optimizer.step(); optimizer.zero_grad()).
        # Without pipeline stages, run.model(x) / run.backward(loss) / run.step() work as well.
        run.train_step(x, y, loss_fn)
        if run.stop_requested:  # SIGTERM (preemption): the checkpoint of this step is written
            break
    step = run.step_count
    data_wait_s = loader.wait_s_total

    summary = run.finish()  # may save a last checkpoint, the loader's position with it
    loader.close()
    if run.stop_requested:  # exit 143: the launcher (and Kubernetes) count it as a preemption, not a failure
        slipstream.shutdown(exit_code=slipstream.EXIT_PREEMPTED)
    # Gathering a sharded model is a collective: every rank asks, the first one writes.
    state = run.unwrapped_state_dict() if args.out else None
    if rt.is_main:
        elapsed = time.perf_counter() - started
        print(f"done: {step} steps in {elapsed:.1f} s, final loss {summary['final_loss'] or math.nan:.4f} "
              f"(uniform guess: {math.log(int(vocab)):.4f}), {summary['tokens_per_s'] or 0:.0f} tokens/s on {rt.world_size} rank(s), "
              f"data wait {data_wait_s:.2f} s ({data_wait_s / max(elapsed, 1e-9) * 100:.1f}%)")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save(state, os.path.join(args.out, "model.pt"))
            print(f"saved {os.path.join(args.out, 'model.pt')}")
    # `slipstream run` ends with the run directory and its own summary line, whatever the script prints.
    # Ends the process here: torch's gloo can abort in interpreter teardown (see shutdown's docstring).
    slipstream.shutdown(exit_code=0)


if __name__ == "__main__":
    main()
