"""Convergence guard: falls back to uncompressed synchronisation when compression hurts.

Two cheap signals, checked every ``check_every_steps`` steps with one tiny
all-reduce (so every rank takes the same decision at the same step):

* error-feedback residual ratio: sqrt(sum ||e||^2 / sum ||g||^2) over the
  compressed buckets since the last check, where e is what the codec carries
  to the next step and g the fresh gradient. Error feedback keeps this bounded
  when the compressor keeps enough of the signal; when it does not, the
  residual piles up and the ratio grows. Limit: ``max_error_ratio``
  (default 20: the residual holds more than twenty steps' worth of gradient).
* loss trend, when the training loop reports losses (``observe_loss``): the
  mean of the last ``loss_window`` compressed steps against the mean of the
  uncompressed steps before compression began; fall back when it is higher by
  more than ``loss_tolerance`` (default 10 %): a run that is learning has a
  lower loss later, not a higher one.

The defaults (in parentheses above) live in :class:`~.options.SyncOptions`.
The fallback is one-way for the run and its reason is logged and reported in
``stats()`` as ``sync_fallback_reason``.

Example::

    guard = ConvergenceGuard(max_error_ratio=20.0)
    reason = guard.check(control_wire, codecs)   # None, or why to fall back
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from .compress.base import Codec, Wire
from .options import DEFAULTS


class ConvergenceGuard:
    def __init__(
        self,
        check_every_steps: int = DEFAULTS.check_every_steps,
        max_error_ratio: float = DEFAULTS.max_error_ratio,
        loss_window: int = DEFAULTS.loss_window,
        loss_tolerance: float = DEFAULTS.loss_tolerance,
    ):
        if check_every_steps < 1:
            raise ValueError(f"check_every_steps must be >= 1, got {check_every_steps}")
        if max_error_ratio <= 0 or loss_tolerance <= -1 or loss_window < 1:
            raise ValueError("max_error_ratio must be > 0, loss_tolerance > -1 (a negative one demands a drop), "
                             "loss_window >= 1")
        self.check_every_steps = check_every_steps
        self.max_error_ratio = max_error_ratio
        self.loss_window = loss_window
        self.loss_tolerance = loss_tolerance
        self.compressing = False
        self.baseline_sum = 0.0
        self.baseline_count = 0
        self.recent: deque[float] = deque(maxlen=loss_window)
        self.last_error_ratio: float | None = None
        self.last_loss_ratio: float | None = None
        self.checks = 0

    def observe_loss(self, loss: float | torch.Tensor) -> None:
        """Report this rank's loss for the step. A tensor stays on its device until the
        next check (no host sync per step)."""
        value = loss.detach() if isinstance(loss, torch.Tensor) else float(loss)
        if self.compressing:
            self.recent.append(value)
        else:
            self.baseline_sum = self.baseline_sum + value
            self.baseline_count += 1

    def check(self, wire: Wire, codecs: Iterable[Codec]) -> str | None:
        """Collective (all ranks, same step): the reason to fall back, or None."""
        codecs = list(codecs)
        res = sum(float(c.residual_sq) for c in codecs if c.error_feedback)
        grad = sum(float(c.grad_sq) for c in codecs if c.error_feedback)
        for c in codecs:
            c.reset_signal()
        recent = [float(x) for x in self.recent]  # one host read per check, not per step
        recent = [x if math.isfinite(x) else float("inf") for x in recent]
        v = torch.tensor(
            [res, grad, float(self.baseline_sum), float(self.baseline_count), sum(recent), float(len(recent))],
            dtype=torch.float64,
        )
        wire.allreduce(v)
        res, grad, bsum, bcnt, rsum, rcnt = v.tolist()
        self.checks += 1
        self.last_error_ratio = math.sqrt(res / grad) if grad > 0 else None
        if self.last_error_ratio is not None and not self.last_error_ratio <= self.max_error_ratio:
            return (
                f"error-feedback residual is {self.last_error_ratio:.1f}x the gradient norm "
                f"(limit {self.max_error_ratio:g}x): the compressor drops more than it delivers"
            )
        if bcnt > 0 and rcnt >= self.loss_window * wire.size:
            base, now = bsum / bcnt, rsum / rcnt
            self.last_loss_ratio = now / base if base > 0 else None
            if not now <= base * (1 + self.loss_tolerance):
                return (
                    f"mean loss of the last {int(rcnt / wire.size)} compressed steps ({now:.4g}) is more than "
                    f"{self.loss_tolerance:.0%} above the uncompressed window's ({base:.4g})"
                )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {
            "compressing": self.compressing,
            "baseline_sum": float(self.baseline_sum),
            "baseline_count": self.baseline_count,
            "recent": [float(x) for x in self.recent],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.compressing = bool(state.get("compressing", False))
        self.baseline_sum = float(state.get("baseline_sum", 0.0))
        self.baseline_count = int(state.get("baseline_count", 0))
        self.recent = deque(state.get("recent", []), maxlen=self.loss_window)
