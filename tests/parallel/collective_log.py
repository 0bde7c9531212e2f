"""A record of every collective a process issues, with the group it ran on.

Like torch's ``CommDebugMode`` (a ``TorchDispatchMode`` that lets DTensor turn
its ops into collectives first, then sees those), but keyed by process group:
what matters for gloo with CUDA tensors is which collective reaches which
group, since the training mesh's groups carry device tensors in that mode while
Slipstream's host-gather groups carry CPU copies only.

Example::

    with CollectiveLog() as log:
        run.train_step(x, y, loss_fn)
    log.calls   # Counter({("c10d", "allreduce_", "11"): 4, ...})
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
PLUMBING = ("wait_tensor", "_wrap_tensor_autograd")  # funcol's bookkeeping, not communication

# gloo cannot carry these for CUDA tensors: the functional (and coalesced) all-gather and
# reduce-scatter reach gloo's coalesced path, which copies from device pointers on the host
# and segfaults (pytorch/pytorch#152645; the first H200 run, 2026-12-04); gloo's send/recv
# read the pointer on the host too (Slipstream refuses pp over gloo+CUDA up front).
UNCARRIED_ON_DEVICE = {
    ("_c10d_functional", "all_gather_into_tensor"),
    ("_c10d_functional", "all_gather_into_tensor_coalesced"),
    ("_c10d_functional", "reduce_scatter_tensor"),
    ("_c10d_functional", "reduce_scatter_tensor_coalesced"),
    ("_c10d_functional", "all_to_all_single"),
    ("_c10d_functional_autograd", "all_gather_into_tensor"),
    ("_c10d_functional_autograd", "reduce_scatter_tensor"),
    ("_c10d_functional_autograd", "all_to_all_single"),
    ("c10d", "allgather_into_tensor_coalesced_"),
    ("c10d", "reduce_scatter_tensor_coalesced_"),
    ("c10d", "send"),
    ("c10d", "recv_"),
    ("c10d", "recv_any_source_"),
}


def _group_name(args: tuple) -> str:
    for a in args:
        if isinstance(a, str) and a.isdigit():
            return a  # funcol: the group's registered name
        if isinstance(a, torch.ScriptObject):
            try:
                return torch._C._distributed_c10d.ProcessGroup.unbox(a).group_name
            except (RuntimeError, AttributeError):  # a ReduceOp, not a group
                continue
    return "?"


class CollectiveLog(TorchDispatchMode):
    """Counts (namespace, op, group name) of every collective dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor desugars into collectives first; we see those
        namespace = getattr(func, "namespace", "")
        if namespace in NAMESPACES and func._opname not in PLUMBING:
            self.calls[(namespace, func._opname, _group_name(args))] += 1
        return func(*args, **(kwargs or {}))

    def calls_groups(self) -> set[str]:
        """Every group name a collective ran on."""
        return {k[2] for k in self.calls}

    def on(self, groups: set[str]) -> Counter:
        """The calls on ``groups`` (names) only."""
        return Counter({k: v for k, v in self.calls.items() if k[2] in groups})
