"""Host-side agreements between ranks: small CPU vectors on the gloo control group.

The sync engine takes decisions that every rank must take identically (the
link figures, a guard's fall-back vote, ``auto``'s plan and its verification).
Each is one small all-reduce of figures computed on the host. They go on a
gloo group with CPU tensors (see the rule in :mod:`.topology`): NCCL accepts
CUDA tensors only, and sending host figures to the device and back would
cost a host sync for nothing.

Example::

    control = ControlWire(groups().control)
    figures = control.agree([t_ready, cost], op=dist.ReduceOp.MAX)   # same list on every rank
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class ControlWire:
    """All-reduces of CPU tensors on one gloo group; refuses device tensors."""

    def __init__(self, group: Any):
        self.group = group
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        if group is not None and dist.is_initialized():
            backend = str(dist.get_backend(group))
            # The fake backend of a replacement healing in place (slipstream.resilience.heal) moves nothing
            # until the replacement joins; its control group is a gloo one from then on.
            if backend != "gloo" and not _replacement_pending():
                raise ValueError(f"the control group must be a gloo group (CPU tensors), got backend {backend!r}")
        self.collectives = 0

    def allreduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        """In-place sum (or ``op``) of a CPU tensor over the group; returns ``t``."""
        if t.device.type != "cpu":
            raise ValueError(
                f"control collectives take CPU tensors (host-side figures), got one on {t.device}: "
                "move figures to the host once, or send device data on a data group"
            )
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op is None else op, group=self.group)
            self.collectives += 1
        return t

    def agree(self, values: Sequence[float], op: Any = None) -> list[float]:
        """The ``op`` (default sum) over ranks of a list of floats, as floats."""
        return self.allreduce(torch.tensor(list(values), dtype=torch.float64), op).tolist()


def _replacement_pending() -> bool:
    from ..resilience import heal

    return heal.on_fake_group()


__all__ = ["ControlWire"]
