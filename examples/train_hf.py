"""Train a small Hugging Face causal LM (Llama or GPT-2, from a config) on the stdlib's source code.

For scripts that start from transformers: the model, its output (``outputs.loss``)
and its batch (``input_ids``, ``attention_mask``, ``labels``) are the usual ones;
Slipstream wraps the model and runs the step. The model is built from a config,
so nothing is downloaded; tokens are bytes (vocabulary 256), so no tokenizer either.

    python examples/train_hf.py --steps 50                  # one process
    slipstream run -n 2 examples/train_hf.py --steps 200    # two, data parallel
    slipstream run -n 2 --precision bf16 --sync powersgd examples/train_hf.py
    torchrun --nproc-per-node 2 examples/train_hf.py        # also works

To start from a pretrained model instead, build it with
``AutoModelForCausalLM.from_pretrained(name)`` and tokenize with its tokenizer;
the Slipstream lines stay the same. They are marked "# slipstream".
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch

try:
    import transformers
except ImportError:
    print("examples/train_hf.py needs transformers: pip install 'slipstream[hf]'", file=sys.stderr)
    sys.exit(2)

import slipstream  # slipstream
from slipstream.names import renamed_flag  # slipstream

VOCAB = 256  # byte tokens


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


def build_model(arch: str, hidden: int, layers: int, context: int) -> transformers.PreTrainedModel:
    """A fresh causal LM from a config, as from_pretrained would build it (without the weights)."""
    heads = max(1, hidden // 32)
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=context,
            tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=context,
            bos_token_id=0, eos_token_id=0,
        )
    config.use_cache = False  # training: no key/value cache in the outputs
    return transformers.AutoModelForCausalLM.from_config(config)


def batch_for(step: int, rank: int, corpus: torch.Tensor, batch: int, context: int, seed: int) -> dict:
    """Random windows as the usual transformers batch, a pure function of (seed, step, rank):
    a resumed run sees the same data. The model shifts ``labels`` itself."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, corpus.numel() - context, (batch,), generator=g)
    ids = torch.stack([corpus[s : s + context] for s in starts])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=("llama", "gpt2"), default="llama")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per data-parallel rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--out", default=None, help="directory for the final model (model.pt, and save_pretrained's files)")
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here; resume from the newest complete one")
    p.add_argument("--checkpoint-every-steps", type=int, default=None, help="save every N optimizer steps")
    p.add_argument("--checkpoint-every", type=int, default=None, help=argparse.SUPPRESS)  # the old name, until 0.2
    args = p.parse_args()
    args.checkpoint_every_steps = renamed_flag(args.checkpoint_every_steps, args.checkpoint_every, "--checkpoint-every")
    if args.steps < 1 or args.batch_size < 1:
        p.error("--steps and --batch-size must be >= 1")

    rt = slipstream.init()  # slipstream: process group, device (NCCL on GPUs, gloo on CPUs)
    torch.manual_seed(args.seed)  # same initial weights on every rank
    corpus = load_corpus(int(args.corpus_mb * 2**20))
    model = build_model(args.arch, args.hidden, args.layers, args.context)
    params = sum(p.numel() for p in model.parameters())
    warmup = max(1, args.steps // 20)
    run = slipstream.accelerate(  # slipstream: DDP, precision, accumulation, checkpoints, metrics
        model,
        lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01),
        scheduler=lambda opt: transformers.get_cosine_schedule_with_warmup(opt, warmup, args.steps),
        total_steps=args.steps, checkpoint_dir=args.checkpoint_dir, checkpoint_every_steps=args.checkpoint_every_steps,
    )
    if rt.is_main:
        c = run.config
        print(f"{type(model).__name__}: {params / 1e6:.2f}M parameters, corpus {corpus.numel() / 2**20:.1f} MiB, "
              f"{rt.world_size} rank(s) on {rt.device}, precision {c.numerics.precision}, sync {c.sync.strategy}")

    started = time.perf_counter()
    # run.step_count and run.micro_step_count come back from a checkpoint on
    # resume, so the loop and the data continue where they stopped.
    while run.step_count < args.steps:
        batch = batch_for(run.micro_step_count, run.dp_rank, corpus, args.batch_size, args.context, args.seed)
        batch = {k: v.to(rt.device) for k, v in batch.items()}
        # slipstream (was: outputs = model(**batch); outputs.loss.backward(); optimizer.step(); ...).
        # The output keeps its type in every precision (logits back in fp32); run.train_step(batch)
        # does these three lines in one.
        outputs = run.model(**batch)  # slipstream
        run.backward(outputs.loss)  # slipstream: synchronises the gradients on the last micro-step
        if run.step().stop_requested:  # slipstream: SIGTERM (preemption): the checkpoint of this step is written
            break
    step = run.step_count

    summary = run.finish()  # slipstream
    if run.stop_requested:  # exit 143: the launcher (and Kubernetes) count it as a preemption, not a failure
        slipstream.shutdown(exit_code=slipstream.EXIT_PREEMPTED)
    # The whole model's weights under their original names (a collective on sharded layouts: every rank asks).
    state = run.unwrapped_state_dict() if args.out else None
    if rt.is_main:
        elapsed = time.perf_counter() - started
        print(f"done: {step} steps in {elapsed:.1f} s, final loss {summary['final_loss']:.4f} "
              f"(uniform guess: {math.log(VOCAB):.4f}), {summary['tokens_per_s'] or 0:.0f} tokens/s on {rt.world_size} rank(s)")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            torch.save(state, os.path.join(args.out, "model.pt"))
            model.save_pretrained(args.out, state_dict=state)  # loadable with from_pretrained(args.out)
            print(f"saved {os.path.join(args.out, 'model.pt')} and the transformers files in {args.out}")
    # Ends the process here: torch's gloo can abort in interpreter teardown (see shutdown's docstring).
    slipstream.shutdown(exit_code=0)


if __name__ == "__main__":
    main()
