"""Peer copies of in-memory snapshots: a node that is lost with its memory loses no state.

A rank's snapshots (:mod:`.snapshots`) live in its node's host memory, which outlives the
worker but not the machine. With more than one node, each snapshot's bytes also go to one
rank on the next node, its *buddy*: rank r's buddy is the rank at r's position on the node
after r's (nodes in a ring; with the same ranks per node, r + local_world_size mod world).
The buddy keeps them in two slots of its own, with the same discipline as the local ones
(the older slot's index deleted first, the bytes received straight into its reserved,
mapped buffer, the index written last): a peer copy is complete or it is ignored.

The copy runs in a background thread on a gloo group of its own, while the next step
trains: each due step, every rank hands its thread the slot it has just written and the
thread, with the buddy's and the sources' threads, exchanges a header (step, sizes), an
answer (1: the holder has room, 0: it has not) and then the index and the buffer
(``isend``/``irecv``: a ring of sends, no rank waits on another's order). The loop waits
only when it is about to hand over the next snapshot while the previous one is still
travelling: that wait, with the local copy, is the snapshot's stall. A rank whose
snapshots are off still answers every due step (a header saying so), so no thread waits
for a copy that never comes. A holder whose tmpfs cannot reserve the copy says so in one
line and answers 0 from then on: that rank's peer copy is off, its own snapshots go on.

On restart (:func:`choose`), the ranks gather what each holds, locally and for whom, and
take the newest step held for *every* rank, by itself or by a holder; each rank whose own
copy is gone receives it from the holder (:func:`fetch`) before the ranks agree and load.
When some rank has the step neither way, every rank loads the disk checkpoint.

Under healing in place (:mod:`slipstream.resilience.heal`) the copy's group goes with the broken default
group: :meth:`PeerCopy.left` retires this copy (its thread commits nothing more: a copy that
was travelling when a rank died may be half received) and the checkpoint manager forms a new
one on the next generation's group (:meth:`PeerCopy.for_job` again, every rank in the same
order). A replacement makes its copy only then: until it joined, its group is a fake one that
moves no data. The copies already held stay, so a replacement whose node lost its memory
takes its predecessor's snapshot from its buddy (:func:`choose`, :func:`fetch`).

Example::

    copy = PeerCopy.for_job(rank, group, snapshots.peer_slots)   # a collective; None on one node
    copy.offer(step, slot_buffer, index_bytes)                     # after each local snapshot
    copy.close()
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..process import runtime

log = logging.getLogger("slipstream.checkpoint")

# Point-to-point tags of the peer group (the copy) and of the checkpoint group (a restore).
TAG_HEADER, TAG_ANSWER, TAG_INDEX, TAG_DATA = 71, 72, 73, 74
TAG_FETCH_HEADER, TAG_FETCH_INDEX, TAG_FETCH_DATA = 81, 82, 83
SLOW_OFFERS = 5
"""Snapshots in a row whose hand-over waited for the previous copy before rank 0 says so."""


class SlotStore(Protocol):
    """What this module needs of :class:`~.snapshots.Slots` (imported there, not here: no cycle)."""

    def claim(self) -> int: ...
    def buffer(self, slot: int, size: int) -> torch.Tensor: ...
    def commit(self, step: int, slot: int, index: bytes) -> None: ...
    def read_raw(self, step: int) -> tuple[bytes, torch.Tensor]: ...
    def clear(self) -> None: ...


def buddies(places: Sequence[tuple[int, int]]) -> dict[int, int]:
    """{rank: its buddy}, given each rank's (node, local rank); {} when every rank is on one node.

    The buddy of a rank is the rank at the same position on the next node (nodes in a ring).

    Example::

        buddies([(0, 0), (0, 1), (1, 0), (1, 1)])   # {0: 2, 1: 3, 2: 0, 3: 1}
    """
    nodes = sorted({node for node, _ in places})
    if len(nodes) < 2:
        return {}
    on = {n: [r for _, r in sorted((local, r) for r, (node, local) in enumerate(places) if node == n)] for n in nodes}
    out = {}
    for rank, (node, _) in enumerate(places):
        following = on[nodes[(nodes.index(node) + 1) % len(nodes)]]
        out[rank] = following[on[node].index(rank) % len(following)]
    return out


@dataclass(frozen=True)
class Choice:
    """What a restart loads: ``step`` (None: the disk checkpoint), and for the ranks whose own
    snapshot of it is gone, the rank that holds its copy; ``missing``: ranks with no step at all."""

    step: int | None
    from_peers: dict[int, int] = field(default_factory=dict)
    missing: tuple[int, ...] = ()


def choose(held: Sequence[Mapping[str, Any]]) -> Choice:
    """The newest step held for every rank, locally or as a peer copy, and who sends which copy.

    ``held[r]``: rank r's {"local": steps, "held": {source rank: steps}}. Pure: every rank
    computes the same answer from the same gathered list. The holder of a copy is the
    lowest rank holding it.

    Example::

        choose([{"local": [4, 5], "held": {1: [4, 5]}}, {"local": [], "held": {}}])
        # Choice(step=5, from_peers={1: 0}, missing=())
    """
    world = len(held)
    available = [set(h["local"]) for h in held]
    for h in held:
        for source, steps in h["held"].items():
            if 0 <= source < world:
                available[source] |= set(steps)
    common = set.intersection(*available) if available else set()
    if not common:
        return Choice(None, {}, tuple(r for r in range(world) if not available[r]))
    step = max(common)
    from_peers = {r: min(h for h in range(world) if step in held[h]["held"].get(r, ()))
                  for r in range(world) if step not in held[r]["local"]}
    return Choice(step, from_peers)


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class PeerCopy:
    """This rank's side of the peer copy: sends its snapshots to ``buddy``, keeps those of
    ``sources`` (the ranks whose buddy it is) in ``slots_for(source)``. See the module docstring."""

    def __init__(self, rank: int, buddy: int, sources: Sequence[int], slots_for: Callable[[int], SlotStore],
                 group: Any) -> None:
        self.rank, self.buddy, self.sources = rank, buddy, tuple(sources)
        self.slots = {source: slots_for(source) for source in self.sources}
        self.group = group
        self.transfer_s: list[float] = []  # each copy's time in the background thread
        self.waited_s: list[float] = []  # the loop's wait for the previous copy, at each offer()
        self.broken: str | None = None  # why the copy stopped (a peer gone: the job restarts or heals)
        self.retired = False  # left(): the group it used is gone; its thread commits nothing more
        self._no_room: set[int] = set()  # sources this rank has no room for
        self._last_offer: float | None = None
        self._slow_offers = 0  # offers in a row that waited for the previous copy (rank 0 says so once)
        self._queue: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._loop, name="slipstream-peer-copy", daemon=True)
        self._thread.start()

    @classmethod
    def for_job(cls, rank: int, group: Any, slots_for: Callable[[int], SlotStore]) -> "PeerCopy | None":
        """This rank's peer copy, or None when every rank is on one node. A collective on ``group``
        (every rank, with the same answer): the ranks' places are gathered, and a gloo group made
        for the copy when there is more than one node."""
        launch = runtime.detect_launch_env()
        places: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(places, (launch.node_rank, launch.local_rank), group=group)
        ring = buddies(places)
        if not ring:
            return None
        copy_group = dist.new_group(backend="gloo", timeout=runtime.group_timeout())
        return cls(rank, ring[rank], [r for r, b in ring.items() if b == rank], slots_for, copy_group)

    def offer(self, step: int, buffer: torch.Tensor | None, index: bytes) -> None:
        """Hand the snapshot of ``step`` (its slot's buffer and index; None: this rank has none) to
        the background thread, once the previous one has travelled. Main thread, every due step."""
        started = time.perf_counter()
        self._idle.wait()
        now = time.perf_counter()
        self.waited_s.append(now - started)
        self._note_waits(now - started, started - self._last_offer if self._last_offer is not None else None)
        self._last_offer = now
        if self.broken is not None:
            return
        self._idle.clear()
        self._queue.put((step, buffer, index))

    def _note_waits(self, waited_s: float, between_s: float | None) -> None:
        """One line (rank 0) once the loop has waited for the previous copy at SLOW_OFFERS snapshots
        in a row: the copy takes longer than the time between two snapshots (a slow link)."""
        slow = between_s is not None and waited_s > 0.1 * (between_s + waited_s)
        self._slow_offers = self._slow_offers + 1 if slow else 0
        if self._slow_offers == SLOW_OFFERS and self.rank == 0 and self.transfer_s:
            copy_s = sorted(self.transfer_s)[len(self.transfer_s) // 2]
            log.warning("the snapshots' peer copy takes %.2f s, longer than the %.2f s between two snapshots: the "
                        "training loop waits %.2f s for it at each one; take snapshots about %dx less often "
                        "(snapshot_every_steps) or turn the copy off (--no-snapshot-peer-copy)",
                        copy_s, between_s, waited_s, math.ceil(copy_s / max(between_s, 1e-3)))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Whether the copy in flight (if any) has travelled, after waiting up to ``timeout_s``."""
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Let the copy in flight finish, stop the thread, destroy the copy's group."""
        finished = self.wait(timeout_s)
        self._queue.put(None)
        if finished:
            self._thread.join(timeout=5)
        if self.group is not None and dist.is_initialized() and not self._thread.is_alive():
            dist.destroy_process_group(self.group)
        self.group = None

    def left(self) -> None:
        """Healing in place: the default group (and this copy's group with it) was destroyed. The
        copy in flight, if any, ends on its own (its peer is gone, or its bytes are let go): from
        now on nothing is committed nor offered, and :meth:`close` destroys no group."""
        self.retired = True
        if self.broken is None:
            self.broken = "left: healing in place formed the groups again"
        self.group = None
        self._queue.put(None)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            started = time.perf_counter()
            try:
                self._exchange(*job)
            except Exception as exc:  # noqa: BLE001 - a peer gone mid-copy: the training's collectives say so
                self.broken = f"{type(exc).__name__}: {exc}"
                log.warning("rank %d: peer copy of snapshots stopped (%s)", self.rank, str(exc).splitlines()[0][:200])
            finally:
                self.transfer_s.append(time.perf_counter() - started)
                self._idle.set()

    def _exchange(self, step: int, buffer: torch.Tensor | None, index: bytes) -> None:
        """One due step: headers, answers, then the bytes, to the buddy and from the sources."""
        g = self.group
        size = buffer.numel() if buffer is not None else -1
        header = torch.tensor([step, size, len(index)], dtype=torch.int64)
        incoming = {s: torch.zeros(3, dtype=torch.int64) for s in self.sources}
        _wait_all([dist.isend(header, self.buddy, group=g, tag=TAG_HEADER)]
                  + [dist.irecv(t, s, group=g, tag=TAG_HEADER) for s, t in incoming.items()])
        places = {s: self._reserve(s, *map(int, t)) for s, t in incoming.items()}
        answer = torch.zeros(1, dtype=torch.int64)
        _wait_all([dist.isend(torch.tensor([int(places[s] is not None)]), s, group=g, tag=TAG_ANSWER)
                   for s in self.sources] + [dist.irecv(answer, self.buddy, group=g, tag=TAG_ANSWER)])
        works = []
        if buffer is not None and answer.item():
            works += [dist.isend(_bytes_tensor(index), self.buddy, group=g, tag=TAG_INDEX),
                      dist.isend(buffer, self.buddy, group=g, tag=TAG_DATA)]
        received = {}
        for s, place in places.items():
            if place is not None:
                slot, target, index_size = place
                received[s] = (slot, torch.empty(index_size, dtype=torch.uint8))
                works += [dist.irecv(received[s][1], s, group=g, tag=TAG_INDEX),
                          dist.irecv(target, s, group=g, tag=TAG_DATA)]
        _wait_all(works)
        if self.retired:  # the groups were formed again meanwhile: a newer copy owns the slots now
            return
        for s, (slot, got) in received.items():
            self.slots[s].commit(int(incoming[s][0]), slot, got.numpy().tobytes())

    def _reserve(self, source: int, step: int, size: int, index_size: int) -> tuple[int, torch.Tensor, int] | None:
        """(slot, its buffer, index size) where ``source``'s snapshot of ``step`` goes, or None:
        it sent none (its snapshots are off: its old copies are deleted too) or there is no room."""
        slots = self.slots[source]
        if size < 0:
            slots.clear()
            return None
        if source in self._no_room:
            return None
        try:
            slot = slots.claim()
            return slot, slots.buffer(slot, size), index_size
        except (OSError, RuntimeError) as exc:  # ENOSPC from the reservation
            self._no_room.add(source)
            slots.clear()
            log.warning("the peer copy of rank %d's snapshots is off: rank %d cannot hold it (%s; two copies need "
                        "%.0f MiB); a node lost with rank %d recovers from disk checkpoints",
                        source, self.rank, exc, 2 * size / 2**20, source)
            return None


def fetch(step: int, rank: int, from_peers: Mapping[int, int], local: SlotStore,
          held_for: Callable[[int], SlotStore], group: Any) -> tuple[bytes, torch.Tensor]:
    """This rank's snapshot of ``step`` as (index bytes, buffer bytes): its own, or, when
    ``from_peers`` names its holder, received from there. A collective on ``group`` among the
    ranks of ``from_peers``: each holder sends the copies it is named for (a header of -1 when
    it cannot read one: the receiver raises, and the ranks' agreement then goes to disk)."""
    sends = []
    try:
        for target, holder in sorted(from_peers.items()):
            if holder != rank:
                continue
            try:
                index, data = held_for(target).read_raw(step)
            except Exception as exc:  # noqa: BLE001 - the receiving rank says so; every rank goes to disk
                log.warning("rank %d cannot read its peer copy of rank %d's step %d: %s", rank, target, step, exc)
                sends.append(dist.isend(torch.tensor([-1, -1], dtype=torch.int64), target, group=group,
                                        tag=TAG_FETCH_HEADER))
                continue
            sends += [dist.isend(torch.tensor([len(index), data.numel()], dtype=torch.int64), target, group=group,
                                 tag=TAG_FETCH_HEADER),
                      dist.isend(_bytes_tensor(index), target, group=group, tag=TAG_FETCH_INDEX),
                      dist.isend(data, target, group=group, tag=TAG_FETCH_DATA)]
        if rank not in from_peers:
            return local.read_raw(step)
        holder = from_peers[rank]
        sizes = torch.zeros(2, dtype=torch.int64)
        dist.recv(sizes, holder, group=group, tag=TAG_FETCH_HEADER)
        if sizes[0] < 0:
            raise OSError(f"rank {holder} could not read its peer copy of this rank's snapshot of step {step}")
        index_t = torch.empty(int(sizes[0]), dtype=torch.uint8)
        data = torch.empty(int(sizes[1]), dtype=torch.uint8)
        dist.recv(index_t, holder, group=group, tag=TAG_FETCH_INDEX)
        dist.recv(data, holder, group=group, tag=TAG_FETCH_DATA)
        return index_t.numpy().tobytes(), data
    finally:
        _wait_all(sends)
