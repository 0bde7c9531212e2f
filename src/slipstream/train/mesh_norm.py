"""Pure helpers for the global gradient norm on a device mesh (no collectives here).

A gradient may be sharded over some of the mesh's dimensions (FSDP2's
``dp_shard``, TP's ``tp``) and replicated over others. Its squares are summed
locally per *sharding pattern* (which dimensions it is split over), so that one
all-reduce per mesh dimension, over the patterns that dimension splits, counts
every element exactly once: see :meth:`slipstream.train.layout_mesh.MeshLayout.global_grad_norm`.

Example::

    local_square_sums([torch.ones(3)], ("dp_shard",), torch.device("cpu"))   # tensor([3., 0.])
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

GRAD_DIMS = ("dp_replicate", "dp_shard", "tp")
"""Mesh dimensions a gradient may be sharded over (pipeline stages are summed apart)."""


def placement_mask(grad: Any, dims: tuple[str, ...]) -> int | None:
    """Bit i set when ``grad`` (a DTensor) is sharded over ``dims[i]``; 0 for a plain tensor.

    None when its squares cannot be summed locally: a Partial placement (the local
    values are addends of the gradient, not pieces of it) or a mesh dimension outside ``dims``.
    """
    placements = getattr(grad, "placements", None)
    if placements is None:
        return 0
    names = grad.device_mesh.mesh_dim_names or ()
    mask = 0
    for i, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if placement.is_partial():
            return None
        # Any other placement holds a distinct piece per rank: Shard, and also FSDP2's
        # _StridedShard under TP, which torch 2.13 does not count as is_shard().
        if i >= len(names) or names[i] not in dims:
            return None
        mask |= 1 << dims.index(names[i])
    return mask


def sharded_dims(params: Iterable[Any], dims: tuple[str, ...]) -> set[str]:
    """The dimensions of ``dims`` any parameter is sharded over (from placements, not values)."""
    out: set[str] = set()
    for p in params:
        mask = placement_mask(p, dims)
        out.update(d for i, d in enumerate(dims) if mask and mask & (1 << i))
    return out


def local_square_sums(grads: list[Any], dims: tuple[str, ...], device: torch.device) -> torch.Tensor:
    """fp32 sums of squares of this rank's gradient pieces, one entry per sharding pattern.

    Entry ``m`` holds the gradients sharded exactly over the dims whose bit is set
    in ``m``, so that summing entry ``m`` over those dims' groups (and no others)
    counts every element once. Gradients that cannot be summed locally (see
    :func:`placement_mask`) are reduced whole here, one collective each (none of
    the layouts here produce them).

    Example::

        local_square_sums([torch.ones(3)], ("dp_shard",), torch.device("cpu"))   # tensor([3., 0.])
    """
    by_mask: dict[int, list[torch.Tensor]] = {}
    whole: list[torch.Tensor] = []
    for g in grads:
        mask = placement_mask(g, dims)
        if mask is None:
            n = torch.linalg.vector_norm(g)
            whole.append((n.full_tensor() if hasattr(n, "full_tensor") else n).float().square())
        else:
            by_mask.setdefault(mask, []).append(g.to_local() if hasattr(g, "to_local") else g)
    square = torch.zeros(1 << len(dims), device=device, dtype=torch.float32)
    for mask, local in by_mask.items():
        # One fused kernel per pattern; norms in fp32 even for bf16 gradients.
        norms = torch._foreach_norm(local, 2, dtype=torch.float32)
        square[mask] = torch.stack([n.to(device) for n in norms]).square().sum()
    for sq in whole:
        square[0] += sq.to(device)
    return square
