"""One GPU per rank under NCCL: which GPUs a process sees, and two ranks on one device refused.

Split from runtime.py: :func:`slipstream.process.runtime.init` reads the visible GPUs through
:func:`visible_gpus` (tests replace it to fake a machine) and, after the group starts,
exchanges each rank's :class:`GpuClaim` with :func:`agree_gpu_binding`, so per-task
binding (``srun --gpus-per-task=1``, a CUDA_VISIBLE_DEVICES per rank) is accepted and
a real share of one device is refused on every rank with the same message.

Example::

    refuse_shared_gpus([GpuClaim(0, "n1", "GPU-a", 0, "0"), GpuClaim(1, "n1", "GPU-b", 0, "1")])  # accepted
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..errors import ConfigError


def visible_gpus() -> tuple[str, ...]:
    """The identities (UUIDs) of the GPUs this process sees, in CUDA index order; () without CUDA.

    Two processes that see the same UUID use the same physical GPU, whatever
    their CUDA_VISIBLE_DEVICES say. :func:`init` reads GPUs only through this
    function (tests replace it to fake a machine).

    Example::

        visible_gpus()   # ("GPU-5d3c9b1e-...",) under srun --gpus-per-task=1
    """
    if not torch.cuda.is_available():
        return ()
    return tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))


@dataclass(frozen=True)
class GpuClaim:
    """The GPU one rank uses, as the ranks exchange it to find two on the same device."""

    rank: int
    host: str
    gpu: str  # the device's identity (UUID), from visible_gpus()
    index: int  # its CUDA index in this process
    visible: str | None  # CUDA_VISIBLE_DEVICES of this process, for the message


def refuse_shared_gpus(claims: Sequence[GpuClaim]) -> None:
    """Raise :class:`ConfigError` when two ranks on one host claim the same GPU (NCCL needs one GPU per rank).

    Example::

        refuse_shared_gpus([GpuClaim(0, "n1", "GPU-a", 0, "0"), GpuClaim(1, "n1", "GPU-a", 0, "0")])  # ConfigError
    """
    by_gpu: dict[tuple[str, str], list[GpuClaim]] = {}
    for claim in claims:
        by_gpu.setdefault((claim.host, claim.gpu), []).append(claim)
    shared = [group for group in by_gpu.values() if len(group) > 1]
    if not shared:
        return
    lines = []
    for group in shared:
        ranks = ", ".join(str(c.rank) for c in group)
        visible = ", ".join(c.visible if c.visible is not None else "unset" for c in group)
        indexes = ", ".join(f"cuda:{c.index}" for c in group)
        lines.append(f"ranks {ranks} on host {group[0].host} use the same GPU {group[0].gpu} "
                     f"({indexes}; CUDA_VISIBLE_DEVICES={visible})")
    raise ConfigError(
        "; ".join(lines) + ": NCCL needs one GPU per rank; give each rank its own GPU "
        "(srun --gpus-per-task=1, or a distinct CUDA_VISIBLE_DEVICES per rank), start fewer processes per node, "
        "or pass backend='gloo', device='cuda' (slipstream run --backend gloo --device cuda) to share GPUs on purpose"
    )


def agree_gpu_binding(mine: GpuClaim, timeout: datetime.timedelta) -> None:
    """Exchange every rank's :class:`GpuClaim` on a gloo group; every rank raises the same
    :class:`ConfigError` when two ranks of a host share a GPU (a collective: all ranks call it).

    Example::

        agree_gpu_binding(GpuClaim(rt.rank, socket.gethostname(), visible_gpus()[0], 0, "3"), group_timeout())
    """
    group = dist.new_group(backend="gloo", timeout=timeout)
    claims: list[GpuClaim | None] = [None] * dist.get_world_size()
    dist.all_gather_object(claims, mine, group=group)
    refuse_shared_gpus([c for c in claims if c is not None])
