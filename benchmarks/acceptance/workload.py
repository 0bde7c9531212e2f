"""What every ranks configuration trains (benchmarks/acceptance/ranks.py), defined once so its
world-size-1 reference (benchmarks/acceptance/reference.py) trains the same thing: the GPT of
examples/train_gpt.py with the same initial weights, AdamW, and the same rows of data.

Torch only: the reference is a plain PyTorch loop and must not import Slipstream.

Data: a data-parallel rank ``r`` of ``dp`` reads ``batch_for(step, r, ...)`` at each step (ranks
of one tensor-parallel group or one pipeline read the same rows). With equal per-rank batches the
mean of the ranks' mean losses is the mean loss of their rows put together, and averaging their
gradients is the gradient of that mean: the same mathematical step as one rank that reads all
``dp`` slices at once (:func:`global_batch`).

Example::

    model = build_model(ex, {"dim": 64, "layers": 2, "heads": 4, "context": 32, "batch": 8}, "fp32")
    optimizer = make_optimizer(model.parameters())
    x, y = global_batch(ex, step=0, dp=2, corpus=corpus, model_cfg=cfg)   # 16 rows: ranks 0 and 1's
"""

from __future__ import annotations

from typing import Any

import torch

CORPUS_BYTES = int(0.25 * 2**20)  # the stdlib's .py files, first 256 KiB: enough windows for a few steps
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def build_model(ex: Any, model_cfg: dict, param_dtype: str) -> torch.nn.Module:
    """The example's GPT, the same initial weights on every rank and in the reference (seed 0)."""
    torch.manual_seed(0)
    model = ex.GPT(dim=model_cfg["dim"], layers=model_cfg["layers"], heads=model_cfg["heads"],
                   context=model_cfg["context"])
    return model.to(PARAM_DTYPES[param_dtype])


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW at the ranks' settings (a factory for accelerate(), called directly by the reference)."""
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def rank_batch(ex: Any, micro_step: int, dp_rank: int, corpus: torch.Tensor, model_cfg: dict):
    """The rows data-parallel rank ``dp_rank`` trains on at ``micro_step``."""
    return ex.batch_for(micro_step, dp_rank, corpus, model_cfg["batch"], model_cfg["context"], 0)


def global_batch(ex: Any, step: int, dp: int, corpus: torch.Tensor, model_cfg: dict):
    """Every data-parallel rank's rows of ``step``, in rank order: one step of the whole group."""
    parts = [rank_batch(ex, step, r, corpus, model_cfg) for r in range(dp)]
    return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])
