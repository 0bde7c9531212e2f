"""Rank functions for tests/train/test_hf.py: a real transformers model trained by accelerate().

Importable at the top level (the harness spawns), and transformers is imported
inside the functions only, so collecting the tests without it still works.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB, SEQ, PER_RANK = 128, 16, 4


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    """A 2-layer GPT-2 built from a config (no download); no dropout, so runs are deterministic."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def hf_batch(micro_step: int, rank: int) -> dict[str, torch.Tensor]:
    """The usual transformers batch, a pure function of (micro_step, rank): counting
    sequences (each token is the previous one + 1, mod the vocabulary) from one of four
    starts, so the loss falls within a few steps."""
    g = torch.Generator().manual_seed(micro_step * 1009 + rank)
    starts = torch.randint(0, 4, (PER_RANK, 1), generator=g) * 7
    ids = (starts + torch.arange(SEQ)) % VOCAB
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _train(run: Any, until_step: int, rank: int, *, use_train_step: bool) -> list[float]:
    """Train to ``until_step`` from where ``run`` is (a resumed run continues); the per-step losses."""
    losses = []
    while run.step_count < until_step:
        batch = hf_batch(run.micro_step_count, rank)
        if use_train_step:
            loss = run.train_step(batch)
        else:
            outputs = run.model(**batch)
            assert type(outputs).__name__ == "CausalLMOutputWithCrossAttentions", type(outputs)
            assert outputs.logits.dtype == torch.float32 and outputs[1] is outputs.logits
            loss = outputs.loss
            run.backward(outputs.loss)
            assert not run.step().stop_requested
        losses.append(float(loss.detach()))
    return losses


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_hf_everything(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """One spawn, every check's measurements: bf16 through run.model(**batch) /
    run.backward(outputs.loss) / run.step() (with sample and token counts); powersgd at
    fp32 through run.train_step(batch) uninterrupted, and the same interrupted by a
    checkpoint and resumed by a second accelerate() that continues with the other form
    (to compare bitwise)."""
    import slipstream

    slipstream.init()
    out: dict[str, Any] = {}
    opt = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
    common = {"progress": False, "run_dir": None, "log_every_steps": 1}

    run = slipstream.accelerate(tiny_gpt2(), opt, precision="bf16", **common)
    out["bf16_losses"] = _train(run, 10, rank, use_train_step=False)
    out["samples"], out["tokens"] = run.recorder.total_samples, run.recorder.total_tokens
    run.finish()

    sync = {"sync": "powersgd", "sync_options": {"rank": 2}, **common}
    run = slipstream.accelerate(tiny_gpt2(), opt, **sync)
    out["whole_losses"] = _train(run, 8, rank, use_train_step=True)
    out["whole"] = _params(run.module)
    run.finish()

    ckpt = {"checkpoint_dir": f"{tmp}/ckpt", "checkpoint_every_steps": 4, **sync}
    run = slipstream.accelerate(tiny_gpt2(), opt, **ckpt)
    out["first_losses"] = _train(run, 4, rank, use_train_step=True)
    run.finish()
    # A fresh process would build the model with other weights: the checkpoint must win.
    run = slipstream.accelerate(tiny_gpt2(seed=1), opt, **ckpt)
    out["resumed_from"], out["resumed_micro"] = run.resumed_from_step, run.micro_step_count
    out["second_losses"] = _train(run, 8, rank, use_train_step=False)
    out["resumed"] = _params(run.module)
    run.finish()
    return out
