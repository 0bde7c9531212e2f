"""Find the largest micro-batch that fits on the GPU at hand by trying forward + backward.

Only on a CUDA machine: each try builds the layout's per-device share of a transformer
model (its layers on one pipeline stage, full width: tensor parallel is not emulated) and
runs one forward and backward at the micro-batch; ``torch.cuda.OutOfMemoryError`` marks
too large. Doubling, then bisection.

Example::

    probe_max_micro_batch(get_model("gpt-1.3b"), Layout(dp_shard=8, precision="bf16"))   # e.g. 6
"""

from __future__ import annotations

from ..errors import UsageError
from .costmodel import Layout
from .specs import ModelSpec


def _fits(model: ModelSpec, layout: Layout, micro_batch: int) -> bool:
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    dtype = torch.float32 if layout.precision == "fp32" else (
        torch.bfloat16 if layout.precision == "bf16" else torch.float16)
    layers = max(1, model.layers // layout.pp)
    net = None
    try:
        blocks = nn.ModuleList(nn.TransformerEncoderLayer(model.d_model, model.heads, 4 * model.d_model,
                                                          batch_first=True, norm_first=True)
                               for _ in range(layers)).cuda()
        x = torch.randn(micro_batch, model.seq_len, model.d_model, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=dtype, enabled=layout.precision != "fp32"):
            h = x
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False) if layout.activation_checkpointing else b(h)
            h.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        del net
        torch.cuda.empty_cache()


def probe_max_micro_batch(model: ModelSpec, layout: Layout, limit: int = 1024) -> int:
    """Largest micro-batch (<= ``limit``) whose forward + backward fits; 0 if even 1 does not."""
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--probe-memory needs a CUDA GPU; torch.cuda.is_available() is False on this machine")
    if model.kind != "transformer":
        raise UsageError(f"--probe-memory builds transformer layers; {model.name} is a {model.kind}")
    lo, hi = 0, 1
    while hi <= limit and _fits(model, layout, hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(model, layout, mid):
            lo = mid
        else:
            hi = mid
    return lo
