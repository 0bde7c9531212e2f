"""Measure a link: latency (alpha) and bandwidth (beta) of all-reduce on a process group.

The alpha-beta model (:mod:`.link`) says one all-reduce of S bytes on n ranks
takes ``alpha + 2(n-1)/n * S / bytes_per_s``. Two sizes (a small one that shows the
latency, a large one that shows the bandwidth), a few timed repetitions each,
medians, and the slowest rank's figure (all-reduce MAX) so that every rank
fits the same line and takes the same decisions from it.

Example::

    link = probe_link(group)            # collective: every rank of group calls it
    link.seconds(4 << 20)               # predicted time of an all-reduce sending 4 MiB per rank
    link.summary()                      # "2 ranks, latency 0.20 ms, 0.936 Gbit/s"

Where ``auto`` chooses between flat and two-level reduction, :func:`probe_both`
measures the flat group and both levels.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from ..network.link import Link, allreduce_bytes


def probe_link(
    group: Any = None,
    sizes_bytes: tuple[int, int] = (8 << 10, 4 << 20),  # DEFAULT_SIZES
    repeats: int = 3,
    device: torch.device | str = "cpu",
    control: Any = None,
) -> Link:
    """Time all-reduce at two sizes on ``group`` and fit the alpha-beta line: a measured :class:`Link`.

    The timed all-reduces are data collectives: tensors on ``device`` (the
    training device: CUDA under NCCL), timed with CUDA events there, since an
    NCCL call returns at enqueue. The figures are agreed (slowest rank) on
    ``control``, a :class:`~slipstream.sync.control.ControlWire` (default: one
    over ``group``, which must then be a gloo group).
    """
    from ..process.timing import clock_for, duration_s
    from .control import ControlWire

    device = torch.device(device)
    n = dist.get_world_size(group)
    if n <= 1:
        return Link.measured(n, 0.0, float("inf"))
    clock = clock_for(device)
    medians = []
    for size in sizes_bytes:
        t = torch.zeros(max(1, size // 4), device=device)
        dist.all_reduce(t, group=group)  # warm-up (connections, buffers)
        marks = [clock.mark()]
        for _ in range(repeats):
            dist.all_reduce(t, group=group)
            marks.append(clock.mark())
        clock.synchronize(marks[-1:])  # once per size, at set-up: not a training step
        medians.append(statistics.median(duration_s(a, b) for a, b in zip(marks, marks[1:])))
    wire = control if control is not None else ControlWire(group)
    t1, t2 = wire.agree(medians, op=dist.ReduceOp.MAX)
    b1, b2 = (allreduce_bytes(s, n) for s in sizes_bytes)
    bw = (b2 - b1) / max(t2 - t1, 1e-9)
    alpha = max(0.0, t1 - b1 / bw)
    return Link.measured(n, alpha, bw, zip(sizes_bytes, (t1, t2)))


class _SelfAgreeing:
    """A control wire that agrees with itself: one level's figures, agreed job-wide later."""

    size = 1

    def agree(self, values: Any, op: Any = None) -> list[float]:
        return list(values)


DEFAULT_SIZES = (8 << 10, 4 << 20)


def probe_level(group: Any, ranks: int, device: torch.device | str = "cpu",
                sizes_bytes: tuple[int, int] = DEFAULT_SIZES) -> Link:
    """One level's link, timed on its data group, not agreed (:func:`probe_levels` agrees both).

    Example::

        intra = probe_level(g.intra, topo.local_world_size, device)
    """
    if ranks <= 1:
        return Link.measured(1, 0.0, float("inf"))
    return probe_link(group, sizes_bytes=sizes_bytes, device=device, control=_SelfAgreeing())


def probe_levels(g: Any, device: torch.device | str = "cpu", sizes_bytes: tuple[int, int] = DEFAULT_SIZES) -> Any:
    """Both links of a two-level topology (``g``: :class:`~.topology.Groups`), agreed on every rank.

    Collective on every rank: each node probes its own intra group, each local
    index its inter group, then one all-reduce MAX on the control group makes the
    figures (and so every decision taken from them) identical everywhere.
    Returns a :class:`~.policy.HierarchicalCost`.

    Example::

        cost = probe_levels(groups(), device)
        cost.summary()     # "intra-node 2 ranks, ...; inter-node 2 ranks, ..."
    """
    from .control import ControlWire
    from .policy import HierarchicalCost

    topo = g.topology
    control = ControlWire(g.control)
    intra = probe_level(g.intra, topo.local_world_size, device, sizes_bytes)
    inter = probe_level(g.inter, topo.num_nodes, device, sizes_bytes)
    a1, inv1, a2, inv2 = control.agree(
        [intra.alpha_s, 1 / intra.bytes_per_s, inter.alpha_s, 1 / inter.bytes_per_s], op=dist.ReduceOp.MAX)
    intra = Link.measured(intra.ranks, a1, 1 / inv1 if inv1 > 0 else float("inf"), intra.samples)
    inter = Link.measured(inter.ranks, a2, 1 / inv2 if inv2 > 0 else float("inf"), inter.samples)
    return HierarchicalCost(intra, inter, topo.local_world_size, topo.num_nodes)


def probe_both(g: Any, device: torch.device | str = "cpu", sizes_bytes: tuple[int, int] = DEFAULT_SIZES) -> Any:
    """The flat group's link and both levels' (``g``: :class:`~.topology.Groups`), agreed on every rank.

    Collective on every rank: :func:`probe_link` on ``g.flat`` (agreed on the control
    group), then :func:`probe_levels`. Returns a :class:`~.levels.LevelLinks`, what
    ``auto`` decides from where the topology has both levels.

    Example::

        links = probe_both(groups(), device)
        links.summary()   # "flat 4 ranks, ...; hierarchical: intra-node 2 ranks, ...; inter-node 2 ranks, ..."
    """
    from .control import ControlWire
    from .levels import LevelLinks

    flat = probe_link(g.flat, sizes_bytes=sizes_bytes, device=device, control=ControlWire(g.control))
    return LevelLinks(flat, probe_levels(g, device, sizes_bytes))


def link_state(model: Any) -> dict[str, Any] | None:
    """A probed link model (:class:`~slipstream.network.link.Link`, :class:`~.policy.FlatCost`,
    :class:`~.policy.HierarchicalCost`, :class:`~.levels.LevelLinks`) as plain data, for the
    sync state: a replacement healing in place takes its predecessor's figures instead of
    probing alone (every rank must decide from the same ones). None stays None.

    Example::

        link_from_state(link_state(link)) == link     # a Link, LevelLinks: equal
    """
    from .levels import LevelLinks
    from .policy import FlatCost, HierarchicalCost

    if model is None:
        return None
    if isinstance(model, Link):
        return {"kind": "link", "bytes_per_s": model.bytes_per_s, "hop_latency_s": model.hop_latency_s,
                "efficiency": model.efficiency, "fabric": model.fabric, "ranks": model.ranks,
                "samples": [[int(s), float(t)] for s, t in model.samples]}
    if isinstance(model, FlatCost):
        return {"kind": "flat", "link": link_state(model.link), "world_size": model.world_size}
    if isinstance(model, HierarchicalCost):
        return {"kind": "hierarchical", "intra": link_state(model.intra), "inter": link_state(model.inter),
                "local_world_size": model.local_world_size, "num_nodes": model.num_nodes}
    if isinstance(model, LevelLinks):
        return {"kind": "levels", "flat": link_state(model.flat), "hierarchical": link_state(model.hierarchical)}
    raise TypeError(f"not a link model: {type(model).__name__}")


def link_from_state(state: dict[str, Any] | None) -> Any:
    """The link model :func:`link_state` wrote (None stays None)."""
    from .levels import LevelLinks
    from .policy import FlatCost, HierarchicalCost

    if state is None:
        return None
    kind = state["kind"]
    if kind == "link":
        return Link(float(state["bytes_per_s"]), float(state["hop_latency_s"]), float(state["efficiency"]),
                    str(state["fabric"]), int(state["ranks"]), tuple((int(s), float(t)) for s, t in state["samples"]))
    if kind == "flat":
        return FlatCost(link_from_state(state["link"]), int(state["world_size"]))
    if kind == "hierarchical":
        return HierarchicalCost(link_from_state(state["intra"]), link_from_state(state["inter"]),
                                int(state["local_world_size"]), int(state["num_nodes"]))
    if kind == "levels":
        return LevelLinks(link_from_state(state["flat"]), link_from_state(state["hierarchical"]))
    raise ValueError(f"sync state: unknown link kind {kind!r}")
