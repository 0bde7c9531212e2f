"""In-memory snapshots: each rank's training state every N steps, in host memory that outlives the worker.

A worker that dies (SIGKILL, an exception, a lost GPU) is restarted by the elastic
agent; with only disk checkpoints every restart rolls back to the last one, up to a
whole checkpoint interval of redone work. A snapshot is the same state a checkpoint
holds (everything registered with the :class:`~slipstream.checkpoint.CheckpointManager`:
model and optimizer, counters, scheduler and scaler, data position, this rank's RNG
streams and sync state), written by each rank for itself after every Nth optimizer
step into a tmpfs (``/dev/shm``: host memory, which a process's death does not free).
A restarted worker of the same launch loads the newest step that every rank holds,
when it is newer than the newest checkpoint on disk: a killed worker then costs at
most ``every_steps`` steps of redone work (none at the default 1 when it dies between
steps). Disk checkpoints go on at their own cadence. With more than one node, each snapshot
also goes to a rank on another node (:mod:`.peer`), so a node lost with its memory resumes
from there; without that copy, the disk checkpoint is what survives the machine.

Two slots per rank, used in turn. A slot is a buffer file (every tensor's bytes, one
after the other, reserved with ``posix_fallocate`` and mapped once with
``torch.from_file(shared=True)``) and a small index file ``step_<N>.slot<K>`` (the state's
structure, with each tensor replaced by its place in the buffer). Taking a snapshot
deletes the older slot's index, copies every tensor into that slot's buffer (a memory
copy: no serialization, no allocation, measured at 6 ms for 56 MB where ``torch.save``
took 85 ms) and then writes the index (a temporary name, renamed): a slot is complete
or it has no index. The other slot keeps the step before, so a rank killed mid-copy
still holds one; the ranks of a step-synchronous job differ by at most one step.

Layout: ``ROOT/slipstream-snapshots/<checkpoint dir hash>-ws<W>/launcher<PID>/rank<R>/`` (ROOT:
``SLIPSTREAM_SNAPSHOT_DIR`` or ``/dev/shm``), directories 0700. ``rank<R>/owner`` names
the launcher (the worker's parent): the launcher deletes its ranks' snapshots when it
exits, and those of launchers that no longer run (killed with SIGKILL) at its start
(:func:`sweep`). A first attempt (``TORCHELASTIC_RESTART_COUNT`` 0, and an agent that never
joined again after losing the rendezvous store: :func:`~slipstream.resilience.snapshot_dirs.restart_count`)
clears its rank's directory, so a snapshot of an earlier job on the same checkpoint directory
is never loaded. The index is read as plain data (``weights_only``), like checkpoint files.

Sharded tensors (DTensor) are stored as their local shard and rebuilt on the current
tensor's mesh and placements, which is why a snapshot is only loaded into the world
size (and so the layout) that wrote it.

Costs: host memory of twice the rank's state (model plus optimizer), reserved up front;
when the tmpfs cannot hold it, snapshots are turned off with one line (never a SIGBUS
later: the buffers are reserved, not sparse). The time each snapshot holds the loop is
in :attr:`MemorySnapshots.stall_s`.

Example::

    snaps = MemorySnapshots.for_run("ckpt", rank=0, world_size=2, every_steps=1)
    snaps.take(step, {"model_optimizer": state}, {"rng": RNGState()})
    step = snaps.agreed_newest(group)        # a collective: newest step every rank holds, or None
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..resilience import heal, pids
from ..resilience.snapshot_dirs import ENV_ROOT, SUBDIR, owner_pid, restart_count, root_dir, sweep
from . import peer as peer_copy
from .cadence import Agree, Cadence, Choice

__all__ = ["ENV_ROOT", "SUBDIR", "MemorySnapshots", "Slots", "decode", "root_dir", "sweep"]

log = logging.getLogger("slipstream.checkpoint")

SLOTS = 2
MEMORY_ONLY = "memory-only"
"""The job key of snapshots with no checkpoint directory (in place of the directory's hash)."""
TENSOR = "__snapshot_tensor__"  # the index's stand-in for a tensor: {TENSOR: its number}
ALIGN = 64


def _flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor (a DTensor: its local shard) moved to ``tensors`` and replaced by its number."""
    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {TENSOR: len(tensors) - 1}
    if isinstance(value, dict):
        return {k: _flatten(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_flatten(v, tensors) for v in value)
    return value


def _unflatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {TENSOR}:
            return tensors[value[TENSOR]]
        return {k: _unflatten(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unflatten(v, tensors) for v in value)
    return value


def _like(saved: Any, current: Any) -> Any:
    """``saved`` placed like ``current`` (this process's own state of the same structure): each
    tensor on the current tensor's device, a DTensor rebuilt on its mesh and placements."""
    if isinstance(current, DTensor) and isinstance(saved, torch.Tensor):
        return DTensor.from_local(saved.to(current.device), current.device_mesh, current.placements,
                                  run_check=False, shape=current.shape, stride=current.stride())
    if isinstance(current, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(current.device)
    if isinstance(saved, dict) and isinstance(current, dict):
        return {k: _like(v, current[k]) if k in current else v for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(current, (list, tuple)) and len(saved) == len(current):
        return type(saved)(_like(s, c) for s, c in zip(saved, current))
    return saved


def _state_of(obj: Any) -> Any:
    """What a snapshot holds of ``obj``: its ``local_state_dict()`` when it has one (the same
    process's view, cheaper than the distributed one), else its ``state_dict()``."""
    local = getattr(obj, "local_state_dict", None)
    return local() if local is not None else obj.state_dict()


def _load_into(obj: Any, saved: Any) -> None:
    local = getattr(obj, "load_local_state_dict", None)
    placed = _like(saved, _state_of(obj))
    (local if local is not None else obj.load_state_dict)(placed)


def _places(tensors: list[torch.Tensor]) -> tuple[list[tuple[int, str, tuple[int, ...]]], int]:
    """(offset, dtype name, shape) of each tensor in a buffer, and the buffer's size."""
    places, offset = [], 0
    for t in tensors:
        places.append((offset, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return places, max(offset, ALIGN)


def _copy_events(tensors: list[torch.Tensor]) -> "tuple[torch.cuda.Event, torch.cuda.Event] | None":
    """(start, end) timing events on the current CUDA stream, the start recorded now, when a tensor
    to copy is on a CUDA device; else None (a copy on the host is timed by the wall clock)."""
    if not any(t.is_cuda for t in tensors):
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    return start, end


class Slots:
    """Two slots in ``directory``, used in turn: each a buffer file and an index written last.

    The storage both of a rank's own snapshots and of the copies it holds for a rank on
    another node (:mod:`.peer`). Example::

        slots = Slots("/dev/shm/x")
        slot = slots.claim()                          # the older slot, its index deleted
        slots.buffer(slot, size)[:] = payload         # the bytes
        slots.commit(step, slot, index_bytes)         # now a snapshot of ``step``
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._buffers: dict[int, torch.Tensor] = {}  # slot -> its mapped buffer (uint8)

    def held(self) -> dict[int, int]:
        """{step: slot} of the complete snapshots (those with an index)."""
        held = {}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return held
        for name in names:
            stem, _, slot = name.partition(".slot")
            if stem.startswith("step_") and slot.isdigit():
                try:
                    held[int(stem[len("step_"):])] = int(slot)
                except ValueError:
                    continue
        return held

    def steps(self) -> list[int]:
        """The steps held complete, oldest first."""
        return sorted(self.held())

    def index(self, step: int, slot: int) -> str:
        return os.path.join(self.directory, f"step_{step:08d}.slot{slot}")

    def claim(self) -> int:
        """The slot to write next (not the newest step's), its index deleted: from now on it is
        no snapshot until :meth:`commit`. Raises OSError."""
        held = self.held()
        newest = max(held) if held else None
        slot = (held[newest] + 1) % SLOTS if newest is not None else 0
        for old, old_slot in held.items():
            if old_slot == slot:
                os.remove(self.index(old, slot))
        return slot

    def buffer(self, slot: int, size: int) -> torch.Tensor:
        """Slot ``slot``'s buffer of ``size`` bytes, reserved in the tmpfs (ENOSPC now, not SIGBUS later)."""
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() != size:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            path = os.path.join(self.directory, f"slot{slot}.bin")
            self._buffers.pop(slot, None)
            with open(path, "wb") as fh:
                os.posix_fallocate(fh.fileno(), 0, size)
            buffer = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._buffers[slot] = buffer
        return buffer

    def commit(self, step: int, slot: int, index: bytes) -> None:
        """Write the index of ``step`` in ``slot`` (a temporary name, renamed): the slot is a snapshot now."""
        path = self.index(step, slot)
        with open(path + ".tmp", "wb") as fh:
            fh.write(index)
        os.replace(path + ".tmp", path)

    def read_raw(self, step: int) -> tuple[bytes, torch.Tensor]:
        """(index bytes, buffer bytes) of the snapshot of ``step``; raises when it is not complete."""
        slot = self.held()[step]
        with open(self.index(step, slot), "rb") as fh:
            index = fh.read()
        size = load_index(index)["size"]
        with open(os.path.join(self.directory, f"slot{slot}.bin"), "rb") as fh:
            data = torch.frombuffer(bytearray(fh.read(size)), dtype=torch.uint8)
        if data.numel() != size:
            raise OSError(f"snapshot slot {slot} of step {step} holds {data.numel()} of {size} bytes")
        return index, data

    def clear(self) -> None:
        self._buffers.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def load_index(index: bytes) -> dict:
    """A snapshot's index, read as plain data only (a pickled object is refused)."""
    return torch.load(io.BytesIO(index), map_location="cpu", weights_only=True)


def decode(index: bytes, data: torch.Tensor) -> dict:
    """The state a snapshot holds ({"shared": ..., "per_rank": ...}) from its index and buffer bytes."""
    meta = load_index(index)
    if data.numel() < meta["size"]:
        raise OSError(f"snapshot of step {meta.get('step')} holds {data.numel()} of {meta['size']} bytes")
    tensors = []
    for offset, dtype_name, shape in meta["places"]:
        dtype = getattr(torch, dtype_name)
        count = 1
        for n in shape:
            count *= n
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        tensors.append(data[offset:offset + nbytes].view(dtype).view(shape).clone())
    return _unflatten(meta["tree"], tensors)


class MemorySnapshots:
    """One rank's snapshots of one job (see the module docstring)."""

    def __init__(self, directory: str, rank: int, world_size: int, every_steps: int | None,
                 restart_count: int) -> None:
        self.directory = directory
        self.rank, self.world_size = rank, world_size
        # every_steps None: measured and agreed (healing in place without snapshot_every_steps; .cadence)
        self.cadence = Cadence(every_steps)
        self.restart_count = restart_count
        self.enabled = True
        self.stall_s: list[float] = []  # time each snapshot held the training loop
        self.slots = Slots(directory)
        self.peer: peer_copy.PeerCopy | None = None  # the copy on another node: set by the manager
        self.from_peers: dict[int, int] = {}  # agreed_newest(): {rank: the rank holding its copy} to fetch
        if restart_count == 0:  # a new job on this checkpoint directory: nothing of an earlier one is loaded
            shutil.rmtree(directory, ignore_errors=True)
        launcher = owner_pid()
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            with open(os.path.join(directory, "owner"), "w") as fh:
                fh.write(f"{launcher} {pids.start_time(launcher) or ''}")
        except OSError as exc:  # off on this rank alone: it still answers agreed_newest() (with nothing)
            self._turn_off(f"{directory} cannot be made: {exc}")

    @property
    def every_steps(self) -> int:
        """The current cadence: a snapshot of every step divisible by it."""
        return self.cadence.every_steps

    @classmethod
    def for_run(cls, checkpoint_dir: str | None, rank: int, world_size: int, every_steps: int | None,
                environ: Mapping[str, str] | None = None) -> "MemorySnapshots":
        """This rank's snapshots for a job checkpointing to ``checkpoint_dir`` (a path or URL; None: a
        job with no checkpoints on disk, healing in place from snapshots alone)."""
        env = os.environ if environ is None else environ
        if checkpoint_dir is None:
            key = MEMORY_ONLY  # the launcher's pid below tells such jobs apart
        else:
            where = checkpoint_dir if "://" in checkpoint_dir else os.path.abspath(checkpoint_dir)
            key = hashlib.sha256(where.encode()).hexdigest()[:16]
        # The launcher's pid in the path: a worker orphaned by a launcher killed with SIGKILL, still
        # alive for a moment, can never write into the slots of the job relaunched on this directory.
        directory = os.path.join(root_dir(env), f"{key}-ws{world_size}", f"launcher{owner_pid(env)}", f"rank{rank}")
        # A process that replaces a dead rank in place (slipstream run --heal) restores its predecessor's
        # snapshot: for it, the directory is not a new job's even in the first attempt.
        attempt = restart_count(env) or int(env.get(heal.ENV_REPLACEMENT) == "1")
        return cls(directory, rank, world_size, every_steps, attempt)

    def steps(self) -> list[int]:
        """The steps this rank holds a complete snapshot of, oldest first."""
        return self.slots.steps()

    def peer_slots(self, source: int) -> Slots:
        """Where this rank keeps the copies of rank ``source``'s snapshots (:mod:`.peer`)."""
        return Slots(os.path.join(self.directory, f"peer{source}"))

    def scheduled(self, step: int) -> bool:
        """Whether ``step`` is a snapshot step (the same on every rank, snapshots off or not)."""
        return self.cadence.scheduled(step)

    def due(self, step: int) -> bool:
        """Whether this rank takes a snapshot of ``step``."""
        return self.enabled and self.scheduled(step)

    def take(self, step: int, shared: Mapping[str, Any], per_rank: Mapping[str, Any]) -> None:
        """Copy this rank's state of ``step`` into the older slot; complete (indexed) or not at all.
        With a peer copy, the same bytes then go to the buddy rank in the background; a rank whose
        snapshots are off still tells its buddy so (every rank calls this at the same steps)."""
        started = time.perf_counter()
        if not self.enabled:
            if self.peer is not None:
                self.peer.offer(step, None, b"")
            return
        tensors: list[torch.Tensor] = []
        tree = {"shared": {name: _flatten(_state_of(obj), tensors) for name, obj in shared.items()},
                "per_rank": {name: _flatten(_state_of(obj), tensors) for name, obj in per_rank.items()}}
        places, size = _places(tensors)
        device_s = 0.0
        try:
            slot = self.slots.claim()
            buffer = self.slots.buffer(slot, size)
            copy_started = time.perf_counter()
            events = _copy_events(tensors)
            for t, (offset, _, _) in zip(tensors, places):
                nbytes = t.numel() * t.element_size()
                buffer[offset:offset + nbytes].view(t.dtype).view(t.shape).copy_(t)
            if events is not None:
                # A copy from the device first waits for the step's queued kernels: that wait is the
                # step's time, not the snapshot's. The copies' own time is between their events.
                events[1].record()
                events[1].synchronize()
                device_s = events[0].elapsed_time(events[1]) / 1e3
                started += time.perf_counter() - copy_started  # the host's wall time of the copies left out
            index = io.BytesIO()
            torch.save({"step": step, "world_size": self.world_size, "size": size, "places": places, "tree": tree},
                       index)
            self.slots.commit(step, slot, index.getvalue())
        except (OSError, RuntimeError) as exc:  # ENOSPC from the reservation; torch.save's iostream error
            self._turn_off(f"{self.directory}: {exc} (two snapshots of this rank need {2 * size / 2**20:.0f} MiB; "
                           f"set {ENV_ROOT} to a larger tmpfs, or the pod's shm_size)")
            if self.peer is not None:
                self.peer.offer(step, None, b"")
            return
        if self.peer is not None:
            self.peer.offer(step, buffer, index.getvalue())
        self.stall_s.append(time.perf_counter() - started + device_s)

    def on_step(self, step: int, shared: Mapping[str, Any], per_rank: Mapping[str, Any],
                agree: Agree | None) -> tuple[bool, Choice | None]:
        """Every optimizer step, on every rank: :meth:`take` when scheduled, timed for a measured
        cadence, which ``agree`` (a collective; None: one rank) settles once. Returns (whether this
        rank took a snapshot, the cadence chosen at this step or None)."""
        self.cadence.step_began()
        took = False
        if self.scheduled(step):
            taken = len(self.stall_s)
            self.take(step, shared, per_rank)  # with snapshots off: tells the peer so
            took = self.enabled
            if len(self.stall_s) > taken:
                self.cadence.took(step, self.stall_s[-1])
        return took, self.cadence.step_ended(step, agree)

    def _turn_off(self, why: str) -> None:
        self.enabled = False
        self.slots.clear()  # give the memory back
        log.warning("in-memory snapshots are off for rank %d: %s; recovery uses disk checkpoints", self.rank, why)

    def held_for_others(self) -> dict[int, list[int]]:
        """{source rank: steps} of the peer copies this rank holds complete."""
        held = {}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return held
        for name in names:
            if name.startswith("peer") and name[len("peer"):].isdigit():
                steps = self.peer_slots(int(name[len("peer"):])).steps()
                if steps:
                    held[int(name[len("peer"):])] = steps
        return held

    def mark_restarted(self) -> None:
        """This process's group was formed again around it (healing in place): from now on it offers
        its snapshots in :meth:`agreed_newest`, as a restarted worker does."""
        self.restart_count = max(self.restart_count, 1)

    def agreed_newest(self, group: Any = None) -> int | None:
        """The newest step whose snapshot every rank holds, itself or through the peer copy on
        another rank (a collective on ``group``), or None. Sets :attr:`from_peers`.

        Only a restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0) offers what it holds; the
        answer is the same on every rank."""
        looks = self.restart_count > 0
        mine = {"local": self.steps() if looks else [], "held": self.held_for_others() if looks else {}}
        held = [mine]
        if group is not None and self.world_size > 1:
            held = [None] * self.world_size
            dist.all_gather_object(held, mine, group=group)
        choice = peer_copy.choose(held)
        self.from_peers = choice.from_peers
        if choice.step is None and choice.missing and self.rank == 0 and any(h["local"] or h["held"] for h in held):
            log.warning("in-memory snapshots: no step is held for every rank (rank(s) %s hold none, nor does a peer "
                        "copy): loading the newest checkpoint on disk", ", ".join(map(str, choice.missing)))
        return choice.step

    def read(self, step: int, group: Any = None) -> dict:
        """This rank's snapshot of ``step`` as plain data ({"shared": ..., "per_rank": ...}), touching
        no registered object: a rank that cannot read its snapshot says so before any rank loads.

        After :meth:`agreed_newest` chose peer copies (:attr:`from_peers`), a collective on
        ``group``: each holder sends its copy to the rank it is for, that rank reads it from there."""
        if self.from_peers:
            return decode(*peer_copy.fetch(step, self.rank, self.from_peers, self.slots, self.peer_slots, group))
        return decode(*self.slots.read_raw(step))

    @staticmethod
    def apply(tree: dict, shared: Mapping[str, Any], per_rank: Mapping[str, Any]) -> None:
        """Load what :meth:`read` returned into the registered objects."""
        for objects, saved in ((shared, tree["shared"]), (per_rank, tree["per_rank"])):
            for name, obj in objects.items():
                if name in saved:
                    _load_into(obj, saved[name])

    def load(self, step: int, shared: Mapping[str, Any], per_rank: Mapping[str, Any]) -> None:
        """Load this rank's snapshot of ``step`` into the registered objects."""
        self.apply(self.read(step), shared, per_rank)
