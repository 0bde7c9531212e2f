"""Two-level reduction: fast links inside a node, slow links between nodes.

For a bucket of S bytes on nodes of k ranks:

1. reduce-scatter inside the node (each local rank gets the node's sum of 1/k of S);
2. the codec averages that 1/k shard across nodes, over the inter-node group of
   ranks that share a local rank: only S/k per rank crosses the slow link, and
   compression (if any) applies to this step only;
3. all-gather inside the node rebuilds the whole averaged bucket.

With one rank per node, steps 1 and 3 vanish; with one node, step 2 does.

Example::

    h = Hierarchical(groups(topology))
    out = h.reduce(flat, PowerSGD(rank=4), key=0, layout=layout)
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from ..network.link import allreduce_bytes
from .compress.base import Codec, Layout, Piece, Wire, shard_of
from .topology import Groups


class FlatReducer:
    """One level: the codec runs over all ranks."""

    def __init__(self, group: object):
        self.wire = Wire(group)

    @property
    def bytes_sent(self) -> float:
        return self.wire.bytes_sent

    def let_go(self) -> None:
        """Drop the group (healing in place: it was destroyed); :meth:`regroup` gives the new one."""
        self.wire.group = None

    def regroup(self, groups: Groups) -> None:
        """Reduce on ``groups.flat`` from now on (the same ranks: counters kept)."""
        self.wire.group = groups.flat

    def reduce(self, flat: torch.Tensor, codec: Codec, key: Hashable, layout: Layout | None) -> torch.Tensor:
        return codec.reduce(flat, self.wire, key, layout)

    def uncompressed_bytes(self, numel: int, itemsize: int = 4) -> float:
        return allreduce_bytes(numel * itemsize, self.wire.size)


class Hierarchical:
    def __init__(self, groups: Groups):
        self.topology = groups.topology
        self.intra = Wire(groups.intra, groups.topology.local_world_size)
        self.inter = Wire(groups.inter, groups.topology.num_nodes)

    @property
    def bytes_sent(self) -> float:
        return self.intra.bytes_sent + self.inter.bytes_sent

    def let_go(self) -> None:
        """Drop both groups (healing in place: they were destroyed); :meth:`regroup` gives the new ones."""
        self.intra.group = self.inter.group = None

    def regroup(self, groups: Groups) -> None:
        """Reduce on ``groups``' node and peer groups from now on (the same topology: counters kept)."""
        if groups.topology != self.topology:
            raise ValueError(f"regroup: topology {groups.topology} is not this reducer's {self.topology}")
        self.intra.group, self.inter.group = groups.intra, groups.inter

    def reduce(self, flat: torch.Tensor, codec: Codec, key: Hashable, layout: Layout | None) -> torch.Tensor:
        k = self.intra.size
        if k == 1:
            return codec.reduce(flat, self.inter, key, layout)
        # The 1/k shards cut parameters, so a codec's state here is kept per bucket and per
        # shard, not per parameter. DDP lays a bucket's parameters out in one order in a
        # process's first iteration and, after it rebuilds its buckets, in another: a
        # resumed run's first step would find no state for its order. So the shards are
        # cut from the bucket in one canonical order (by parameter index), whatever order
        # DDP hands it over in: the same shard, the same key, the same state every step.
        order = _canonical_order(key, layout)
        if order is None:
            return self._reduce_shards(flat, codec, key, layout)
        assert layout is not None and isinstance(key, tuple)
        pieces = [layout[j] for j in order]
        canon = torch.cat([flat[p.offset:p.offset + p.numel] for p in pieces])
        offsets = [0]
        for p in pieces:
            offsets.append(offsets[-1] + p.numel)
        canon_layout = [Piece(off, p.numel, p.rows, p.cols) for off, p in zip(offsets, pieces)]
        out = self._reduce_shards(canon, codec, tuple(key[j] for j in order), canon_layout)
        for p, q in zip(pieces, canon_layout):
            flat[p.offset:p.offset + p.numel].copy_(out[q.offset:q.offset + q.numel])
        return flat

    def _reduce_shards(self, flat: torch.Tensor, codec: Codec, key: Hashable, layout: Layout | None) -> torch.Tensor:
        k = self.intra.size
        numel = flat.numel()
        shard_numel = -(-numel // k)
        if shard_numel * k != numel:
            padded = torch.zeros(shard_numel * k, dtype=flat.dtype, device=flat.device)
            padded[:numel] = flat
        else:
            padded = flat
        shard = self.intra.reduce_scatter(padded).div_(k)
        # This rank's part of the bucket (auto times its codecs on the same cut: shard_of).
        start, real, shard_layout = shard_of(numel, layout, self.topology.local_rank, k)
        if self.inter.size > 1 and real > 0:
            head = shard[:real]
            # The padded tail (zeros) need not cross the slow link.
            head_out = codec.reduce(head, self.inter, (key, "h"), shard_layout)
            if head_out.data_ptr() != head.data_ptr():
                head.copy_(head_out)
        full = self.intra.allgather(shard).view(-1)
        flat.copy_(full[:numel])
        return flat

    def uncompressed_bytes(self, numel: int, itemsize: int = 4) -> float:
        """Bytes per rank for a plain (flat, fp32) all-reduce of ``numel`` values."""
        return allreduce_bytes(numel * itemsize, self.topology.world_size)


def _canonical_order(key: Hashable, layout: Layout | None) -> list[int] | None:
    """Positions of the bucket's parameters sorted by parameter index, when ``key`` lists
    them one per piece of ``layout`` and they are not in that order already; else None."""
    if layout is None or not isinstance(key, tuple) or len(key) != len(layout):
        return None
    if not all(isinstance(i, int) for i in key):
        return None
    order = sorted(range(len(key)), key=lambda j: key[j])
    return None if order == list(range(len(key))) else order
