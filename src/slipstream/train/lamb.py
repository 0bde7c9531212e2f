"""LAMB (layer-wise adaptive moments) for large-batch training, with linear
learning-rate scaling and warm-up.

torch has no LAMB; this is a plain ``torch.optim.Optimizer`` following You et
al., "Large Batch Optimization for Deep Learning" (2019), Algorithm 2:

    m = b1*m + (1-b1)*g            v = b2*v + (1-b2)*g*g
    m_hat = m / (1-b1^t)           v_hat = v / (1-b2^t)
    r = m_hat / (sqrt(v_hat) + eps) + weight_decay * p
    trust = ||p|| / ||r||  (1 when either norm is 0), optionally clipped to max_trust_ratio
    p = p - lr * trust * r

Example::

    opt = LAMB(model.parameters(), lr=scaled_lr(1e-3, global_batch=4096, base_batch=256))
    sched = warmup_schedule(opt, warmup_steps=100, total_steps=1000)
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..errors import ConfigError


class LAMB(torch.optim.Optimizer):
    """LAMB optimizer. ``weight_decay`` is decoupled (added to the update, as in the paper)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        max_trust_ratio: float | None = 10.0,
        bias_correction: bool = True,
    ) -> None:
        if lr <= 0:
            raise ConfigError(f"lr must be > 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ConfigError(f"betas must be in [0, 1), got {betas}")
        if eps <= 0:
            raise ConfigError(f"eps must be > 0, got {eps}")
        if weight_decay < 0:
            raise ConfigError(f"weight_decay must be >= 0, got {weight_decay}")
        if max_trust_ratio is not None and max_trust_ratio <= 0:
            raise ConfigError(f"max_trust_ratio must be > 0 or None, got {max_trust_ratio}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_trust_ratio=max_trust_ratio,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch.optim.Optimizer contract
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if group["bias_correction"]:
                    m_hat = exp_avg / (1 - beta1 ** state["step"])
                    v_hat = exp_avg_sq / (1 - beta2 ** state["step"])
                else:
                    m_hat, v_hat = exp_avg, exp_avg_sq
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                # Trust ratio stays a tensor: no host sync per parameter.
                w_norm = torch.linalg.vector_norm(p)
                u_norm = torch.linalg.vector_norm(update)
                trust = torch.where(
                    (w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm)
                )
                if group["max_trust_ratio"] is not None:
                    trust = trust.clamp(max=group["max_trust_ratio"])
                p.sub_(update * (trust * group["lr"]))
        return loss


def scaled_lr(base_lr: float, global_batch: int, base_batch: int) -> float:
    """Linear scaling rule: the learning rate grows with the global batch.

    Example::

        scaled_lr(0.1, global_batch=1024, base_batch=256)  # 0.4
    """
    if base_lr <= 0:
        raise ConfigError(f"base_lr must be > 0, got {base_lr}")
    if global_batch < 1 or base_batch < 1:
        raise ConfigError(f"batch sizes must be >= 1, got global_batch={global_batch}, base_batch={base_batch}")
    return base_lr * global_batch / base_batch


def warmup_schedule(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    total_steps: int | None = None,
    decay: str = "cosine",
) -> LambdaLR:
    """Linear warm-up from ~0 to the optimizer's lr, then constant, linear or cosine decay to 0.

    Example::

        sched = warmup_schedule(opt, warmup_steps=100, total_steps=1000, decay="linear")
        # call sched.step() after each optimizer step (Accelerated.step() does it for you)
    """
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if decay not in ("constant", "linear", "cosine"):
        raise ConfigError(f"decay must be 'constant', 'linear' or 'cosine', got {decay!r}")
    if decay != "constant":
        if total_steps is None:
            raise ConfigError(f"decay {decay!r} needs total_steps")
        if total_steps <= warmup_steps:
            raise ConfigError(f"total_steps ({total_steps}) must be > warmup_steps ({warmup_steps})")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))  # type: ignore[operator]
        if decay == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
