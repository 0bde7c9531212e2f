"""Gradient codecs, one algorithm per file. See :mod:`.base` for the contract.

Example::

    from slipstream.sync.compress import make_codec
    make_codec("powersgd", rank=8)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Codec, ErrorFeedback, Layout, Piece, Wire, layout_from_shapes, sub_layout
    from .cast import Cast
    from .powersgd import PowerSGD
    from .sign import ScaledSign
    from .topk import TopK

# The codecs (and torch) are imported on first use (PEP 562): CODECS is read by
# config checks and `slipstream validate`, which need no torch.
_LAZY = {
    "Codec": ".base", "ErrorFeedback": ".base", "Layout": ".base", "Piece": ".base", "Wire": ".base",
    "layout_from_shapes": ".base", "sub_layout": ".base",
    "Cast": ".cast", "PowerSGD": ".powersgd", "ScaledSign": ".sign", "TopK": ".topk",
}

CODECS = ("allreduce", "bf16", "fp16", "powersgd", "topk", "sign")


def make_codec(name: str, **options: Any) -> Codec:
    """A fresh codec by name; ``options`` go to its constructor (e.g. rank=8, density=0.01)."""
    import torch

    from .base import Codec
    from .cast import Cast
    from .powersgd import PowerSGD
    from .sign import ScaledSign
    from .topk import TopK

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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
