"""Held-out loss of a model saved by ``examples/train_gpt.py --out DIR``.

Question it answers: at equal steps, how much quality does a sync strategy cost (DiLoCo
against all-reduce, say)? The training loss a run prints is one replica's last batch; this
scores the saved model on samples it never trained on: the stdlib corpus packed 1 MiB
longer than the training pack, whose first samples are the training pack's (checked), and
whose last ``--samples`` lie past it.

Example::

    python examples/train_gpt.py --dim 128 --layers 2 --out /tmp/m ...
    python -m benchmarks.heldout_gpt /tmp/m/model.pt --dim 128 --layers 2   # held-out loss 2.71 over 512 samples
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from train_gpt import GPT, loss_fn, stdlib_corpus_shards  # noqa: E402

from slipstream.data import ShardedDataset  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="model.pt written by train_gpt.py --out")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--corpus-mb", type=float, default=4.0, help="the training run's --corpus-mb")
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--data-cache", default=os.path.join(os.path.expanduser("~/.cache"), "slipstream"))
    args = p.parse_args()
    train = ShardedDataset(stdlib_corpus_shards(args.data_cache, args.corpus_mb, args.context, 0))
    longer = ShardedDataset(stdlib_corpus_shards(args.data_cache, args.corpus_mb + 1.0, args.context, 0))
    if len(longer) < len(train) + args.samples:
        sys.exit(f"the longer pack has {len(longer)} samples, the training pack {len(train)}: not {args.samples} beyond")
    for i in (0, len(train) // 2, len(train) - 1):
        if not torch.equal(torch.as_tensor(train[i]), torch.as_tensor(longer[i])):
            sys.exit(f"sample {i} differs between the packs: the longer one is not an extension of the training pack")
    model = GPT(vocab=int(train.index.meta["vocab_size"]), dim=args.dim, layers=args.layers, context=args.context)
    model.load_state_dict(torch.load(args.model, map_location="cpu", weights_only=True))
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(len(longer) - args.samples, len(longer), 64):
            idx = range(start, min(start + 64, len(longer)))
            tokens = torch.stack([torch.as_tensor(longer[i]) for i in idx])[:, : args.context + 1].long()
            total += float(loss_fn(model(tokens[:, :-1]), tokens[:, 1:])) * len(idx)
    print(f"held-out loss {total / args.samples:.4f} over {args.samples} samples (past the {len(train)} trained on)")


if __name__ == "__main__":
    main()
