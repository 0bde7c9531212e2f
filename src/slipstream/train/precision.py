"""Mixed precision: autocast context and gradient scaler per precision name."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
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


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The scaler's current loss scale as a 0-dim tensor on its device (None before its
    first ``scale()``), for work on the device that must undo it without a host sync.

    torch keeps it as one tensor that ``update()`` changes in place; ``get_scale()``
    would read it back to the host (a sync per call).

    Example::

        sync.use_loss_scale(lambda: loss_scale(scaler))   # error feedback in true-gradient units
    """
    return scaler._scale


def outputs_to_fp32(value: Any) -> Any:
    """Cast low-precision floating outputs back to fp32, so a loss computed
    outside the model is computed in full precision; keep every container's type.

    Tensors in bf16/fp16 become fp32 (a differentiable cast); other tensors and
    values stay as they are. Containers are walked and rebuilt as their own type
    only where something inside changed, so an fp32 output comes back as the very
    same object: a transformers ``ModelOutput`` (an ``OrderedDict`` that is also
    a dataclass) keeps ``.loss`` and ``out[0]``, a namedtuple or a
    ``torch.return_types`` tuple its field names, a dataclass its class, a
    ``dict``/``list``/``tuple`` subclass its class. Other objects (a KV cache,
    say) are returned untouched, tensors inside them included.

    Example::

        out = outputs_to_fp32(model_output)     # CausalLMOutput(loss=..., logits=<fp32>)
        out.loss, out["logits"], out[1]         # all still work
    """
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _DTYPES.values() else value
    if isinstance(value, tuple):
        return _rebuild_tuple(value)
    if isinstance(value, list):
        items = [outputs_to_fp32(v) for v in value]
        if _unchanged(value, items):
            return value
        if type(value) is list:
            return items
        new = copy.copy(value)  # a list subclass: its class and attributes, the new items
        new[:] = items
        return new
    if isinstance(value, dict):
        changed = {k: c for k, v in value.items() if (c := outputs_to_fp32(v)) is not v}
        if not changed:
            return value
        if type(value) is dict:
            return {k: changed.get(k, v) for k, v in value.items()}
        # A dict subclass (OrderedDict, defaultdict, transformers' ModelOutput): a copy
        # of its own class, then the changed items set through its __setitem__
        # (ModelOutput's keeps the attribute of the same name in step).
        new = copy.copy(value)
        for k, c in changed.items():
            new[k] = c
        return new
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f.name for f in dataclasses.fields(value) if f.init]
        changed = {n: c for n in fields if (c := outputs_to_fp32(v := getattr(value, n))) is not v}
        return dataclasses.replace(value, **changed) if changed else value
    return value


def _unchanged(old: Any, new: list[Any]) -> bool:
    return all(a is b for a, b in zip(old, new))


def _rebuild_tuple(value: tuple[Any, ...]) -> tuple[Any, ...]:
    items = [outputs_to_fp32(v) for v in value]
    if _unchanged(value, items):
        return value
    cls = type(value)
    if cls is tuple:
        return tuple(items)
    if hasattr(cls, "_make"):  # a namedtuple
        return cls._make(items)
    return cls(items)  # torch.return_types.* (structseq) and other tuple subclasses take one iterable
