"""Mixed precision: autocast context and gradient scaler per precision name."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> ContextManager[Any]:
    """The autocast context for ``precision`` on ``device`` (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs dynamic loss scaling (its exponent range underflows small
    gradients); bf16 has fp32's exponent range and does not."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def outputs_to_fp32(value: Any) -> Any:
    """Cast low-precision floating outputs back to fp32, so a loss computed
    outside the model is computed in full precision."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
    if isinstance(value, tuple):
        return tuple(outputs_to_fp32(v) for v in value)
    if isinstance(value, list):
        return [outputs_to_fp32(v) for v in value]
    if isinstance(value, dict):
        return {k: outputs_to_fp32(v) for k, v in value.items()}
    return value
