"""Gradient codecs, one algorithm per file. See :mod:`.base` for the contract.

Example::

    from slipstream.sync.compress import make_codec
    make_codec("powersgd", rank=8)
"""

from __future__ import annotations

from typing import Any

import torch

from .base import (
    Codec,
    ErrorFeedback,
    Layout,
    Piece,
    Wire,
    layout_from_shapes,
    sub_layout,
)
from .cast import Cast
from .powersgd import PowerSGD
from .sign import ScaledSign
from .topk import TopK

CODECS = ("allreduce", "bf16", "fp16", "powersgd", "topk", "sign")


def make_codec(name: str, **options: Any) -> Codec:
    """A fresh codec by name; ``options`` go to its constructor (e.g. rank=8, density=0.01)."""
    if name == "allreduce":
        return Codec()
    if name == "bf16":
        return Cast(torch.bfloat16)
    if name == "fp16":
        return Cast(torch.float16)
    if name == "powersgd":
        return PowerSGD(**options)
    if name == "topk":
        return TopK(**options)
    if name == "sign":
        return ScaledSign(**options)
    raise KeyError(f"unknown codec {name!r}; known: {', '.join(CODECS)}")


__all__ = [
    "CODECS", "Cast", "Codec", "ErrorFeedback", "Layout", "Piece", "PowerSGD", "ScaledSign", "TopK",
    "Wire", "layout_from_shapes", "make_codec", "sub_layout",
]
