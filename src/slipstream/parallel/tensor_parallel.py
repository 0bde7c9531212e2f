"""Tensor parallelism: DTensor's ``parallelize_module`` over a plan of module names.

A plan maps module-name patterns (``fnmatch``, matched against
``named_modules()`` names) to a style. ``"colwise"`` shards a Linear's output
features (its weight's rows) over the ``tp`` ranks, ``"rowwise"`` its input
features; a column-wise layer followed by a row-wise one needs no
communication between them and one all-reduce after (Megatron-LM's MLP and
attention split). Any ``torch.distributed.tensor.parallel.ParallelStyle``
works as a value too. Modules the plan does not name stay replicated (each TP
rank holds the whole tensor and computes the same thing).

Example (the GPT of examples/train_gpt.py)::

    plan = {
        "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
        "blocks.*.attn.out": "rowwise",
        "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise",
    }
    apply_tensor_parallel(model, dims.tp_mesh, plan)

An attention module that splits heads must derive its local head count from
the width of its (sharded) q projection; a module with an integer ``heads``
(or ``n_heads``/``num_heads``) attribute is checked: tp must divide it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import ConfigError

_HEAD_ATTRS = ("heads", "n_heads", "num_heads")


def _style(value):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
    )

    if isinstance(value, ParallelStyle):
        return value
    if value == "colwise":
        return ColwiseParallel()
    if value == "rowwise":
        return RowwiseParallel()
    raise ConfigError(f"tp_plan values must be 'colwise', 'rowwise' or a ParallelStyle, got {value!r}")


def resolve_plan(model: nn.Module, plan: Mapping[str, object]) -> dict[str, object]:
    """Expand the patterns to module names; every pattern must match at least one module."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, object] = {}
    for pattern, style in plan.items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ConfigError(f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__}")
        for name in hits:
            resolved[name] = style
    return resolved


def check_divisible(model: nn.Module, resolved: Mapping[str, object], tp: int) -> None:
    """tp must divide every sharded dimension and every attention head count."""
    for name, style in resolved.items():
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear) and style in ("colwise", "rowwise"):
            dim, size = ("out_features", module.out_features) if style == "colwise" else ("in_features", module.in_features)
            if size % tp:
                raise ConfigError(f"tp({tp}) does not divide {name}.{dim}({size})")
    for name, module in model.named_modules():
        for attr in _HEAD_ATTRS:
            heads = getattr(module, attr, None)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads % tp:
                raise ConfigError(f"tp({tp}) does not divide the attention heads({heads}) of {name or 'the model'}")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, object]) -> int:
    """Shard the modules ``plan`` names over ``tp_mesh``, in place. Returns how many.

    Modules of ``plan`` that are absent (deleted from this pipeline stage) are
    skipped by the pattern match, so one plan serves every stage.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if not plan:
        raise ConfigError("tp > 1 needs a tensor-parallel plan: pass tp_plan={'module.pattern': 'colwise'|'rowwise', ...}")
    names = [name for name, _ in model.named_modules() if name]
    present = {p: s for p, s in plan.items() if any(fnmatch.fnmatchcase(n, p) for n in names)}
    if not present and tp_mesh.size() > 1:
        return 0  # a pipeline stage without any sharded layer (e.g. embeddings only)
    resolved = resolve_plan(model, present)
    check_divisible(model, resolved, tp_mesh.size())
    parallelize_module(model, tp_mesh, {name: _style(style) for name, style in resolved.items()})
    return len(resolved)
