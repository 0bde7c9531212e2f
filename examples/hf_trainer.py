"""Train a small GPT-2 with the Hugging Face Trainer: a plain transformers script, nothing of Slipstream in it.

    python examples/hf_trainer.py                                      # one process
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py    # two, data parallel (DDP, gloo)
    slipstream run -n 2 examples/hf_trainer.py                         # the same line under Slipstream

The model is built from a config and the tokens are generated, so nothing is downloaded.
--out DIR writes rank 0's final weights (DIR/model.pt) and final loss (DIR/result.json).
"""

import argparse
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

VOCAB, CONTEXT = 256, 64


class CountingSequences(torch.utils.data.Dataset):
    """Sequences that count up from a random start in a random stride (mod VOCAB), with a few
    random tokens mixed in: learnable, and the same on every rank and run (a seeded generator)."""

    def __init__(self, size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(VOCAB, (size, 1), generator=g)
        stride = torch.randint(1, 8, (size, 1), generator=g)
        self.tokens = (start + stride * torch.arange(CONTEXT)) % VOCAB
        noise = torch.rand(size, CONTEXT, generator=g) < 0.05
        self.tokens[noise] = torch.randint(VOCAB, (int(noise.sum()),), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}  # the model shifts the labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", help="directory for model.pt and result.json (rank 0)")
    args = parser.parse_args()

    set_seed(0)  # the initial weights
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, use_cache=False)
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.out,  # nothing is saved there but what this script writes
        use_cpu=True,
        # gloo when launched on several processes; alone, none: with one process and a backend
        # set, accelerate asks for the world size of a process group nobody started (ValueError)
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        warmup_steps=max(1, args.steps // 10),
        weight_decay=0.01,
        seed=0,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=CountingSequences(2048))
    output = trainer.train()

    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]  # means over the ranks
    loss = logged[-1] if logged else output.training_loss
    if args.out and trainer.is_world_process_zero():
        os.makedirs(args.out, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in trainer.model.state_dict().items()}
        torch.save(state, os.path.join(args.out, "model.pt"))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"loss": loss, "steps": trainer.state.global_step, "world_size": training_args.world_size}, f)


if __name__ == "__main__":
    main()
