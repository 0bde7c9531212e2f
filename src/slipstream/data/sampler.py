"""ResumableSampler: a deterministic, rank-split order that resumes mid-epoch.

Three orders (``shuffle=``):

* ``"shards"`` (the default when the shard sizes are known, as for a
  ``ShardedDataset`` in ``SlipstreamLoader``): block shuffle. Each epoch the
  order of the shards is permuted, the shard sequence is cut into windows of
  ``window_shards`` shards, and samples are permuted within each window
  (``block_order.BlockOrder``). The ranks take consecutive blocks of that
  order, so each rank reads about ``1/W`` of the shards, each shard is read by
  about one rank per epoch, and a rank works through a window of a few shards
  at a time: a node cache holding a few windows per rank never thrashes.
  Memory is O(shards + window), whatever the number of samples.
* ``"global"``: one permutation of all samples per epoch (the order before
  block shuffling; ``True`` without shard sizes). Every batch is drawn from the
  whole dataset, but every rank touches nearly every shard early in an epoch,
  and the permutation costs 8 bytes per sample. For small data.
* ``"none"`` (or ``False``): ``0..N-1``.

Seeds: the shard permutation of epoch ``e`` comes from
``numpy.random.default_rng([seed, e])``, window ``w``'s permutation from
``default_rng([seed, e, w])``, the global permutation from
``default_rng([seed, e]).permutation(N)`` (PCG64: the same on every platform).

**Positions.** ``start`` (the resume state, with the epoch) is the number of
the epoch's samples the whole job has consumed: after every rank took ``k``
more samples it grows by ``k*W``. How positions are split among ranks:

* global and none (strided, as before): from ``s``, rank ``r`` of ``W`` reads
  positions ``s + r, s + r + W, ...``; position ``p`` is sample
  ``order[p % N]``, so the tail that does not divide evenly wraps around to
  the epoch's first samples (every rank reads the same number, which DDP
  needs), unless ``drop_last`` drops it.
* shards (blocked): the positions not yet read are a list of intervals
  ``segments`` of the epoch's order (``[(0, N)]`` at the start of an epoch),
  ``R`` positions in all. Concatenated, they are cut into ``W`` consecutive
  blocks: ``L = ceil(R/W)`` (``floor`` with ``drop_last``, the rest being the
  dropped tail); the first ``W - P`` ranks take ``L`` positions and the last
  ``P = L*W - R`` take ``L - 1`` followed by one padding position (the
  epoch's position ``0, 1, ...``). Padding is therefore only read at the last
  step, so after ``k < L`` steps exactly ``k*W`` real positions are consumed:
  the first ``k`` of each block.

**When the world size changes** (a job resumes on more or fewer ranks):
strided, the position is kept and the rest of the order is re-split among the
new ranks. Blocked, the state also holds the ``segments`` at the last change
and the world size then; the unread rest of each old block becomes the new
``segments`` (at most ``W`` more intervals) and is cut into ``W'`` blocks.
Either way no sample of the epoch is skipped or read twice, except the
padding at the very end, computed for the new ``W'``. Later epochs are the
same order whatever the world size. A state saved in one mode resumes its
epoch in that mode (an old state, version 1, resumes in "global" or "none");
the next epoch uses the sampler's own mode.
"""

from __future__ import annotations

import zlib
from typing import Iterator

import numpy as np
import torch.utils.data

from ..errors import ConfigError
from .block_order import BlockOrder

STATE_VERSION = 2
MODES = ("shards", "global", "none")
DEFAULT_WINDOW_SHARDS = 4
_CHUNK = 65536  # samples computed at a time when iterating the strided orders


def dist_rank_world() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when initialised, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve_mode(shuffle: bool | str, has_shards: bool) -> str:
    """``True`` -> "shards" with shard sizes, else "global"; ``False`` -> "none"; a mode name as is."""
    if shuffle is True:
        return "shards" if has_shards else "global"
    if shuffle is False or shuffle is None:
        return "none"
    if shuffle not in MODES:
        raise ConfigError(f"shuffle must be True, False or one of {MODES}, got {shuffle!r}")
    if shuffle == "shards" and not has_shards:
        raise ConfigError('shuffle="shards" needs shard_sizes (SlipstreamLoader passes them for a ShardedDataset)')
    return shuffle


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Deterministic per (seed, epoch), split across ranks, resumable from (epoch, position).

    ``rank`` and ``world_size`` default to torch.distributed's. ``shard_sizes``
    (samples per shard, in index order) enables ``shuffle="shards"``, the
    default then; ``window_shards`` is the number of shards shuffled together.
    The sampler yields this rank's indices from ``start`` to the end of
    ``epoch``; the consumer (``SlipstreamLoader``) advances ``start`` by what
    the training loop actually consumed, because a data loader reads ahead.

    Example::

        s = ResumableSampler(len(ds), seed=0, rank=0, world_size=2,
                             shard_sizes=[i.num_samples for i in ds.index.shards])
        s.set_epoch(3)
        s.advance(500)          # every rank read 500 samples
        first = next(iter(s))  # what rank 0 reads next
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        shuffle: bool | str = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        shard_sizes: "list[int] | np.ndarray | None" = None,
        window_shards: int = DEFAULT_WINDOW_SHARDS,
    ):
        if num_samples < 1:
            raise ConfigError(f"num_samples must be at least 1, got {num_samples}")
        if (rank is None) != (world_size is None):
            d_rank, d_world = dist_rank_world()
            rank = d_rank if rank is None else rank
            world_size = d_world if world_size is None else world_size
        elif rank is None:
            rank, world_size = dist_rank_world()
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if drop_last and num_samples < world_size:
            raise ConfigError(f"drop_last with num_samples({num_samples}) < world_size({world_size}) leaves no samples")
        if window_shards < 1:
            raise ConfigError(f"window_shards must be at least 1, got {window_shards}")
        self.num_samples = int(num_samples)
        self.shard_sizes = None if shard_sizes is None else np.asarray(shard_sizes, dtype=np.int64)
        if self.shard_sizes is not None and int(self.shard_sizes.sum()) != self.num_samples:
            raise ConfigError(f"shard_sizes add up to {int(self.shard_sizes.sum())}, not num_samples({self.num_samples})")
        self.mode = resolve_mode(shuffle, self.shard_sizes is not None)
        self.window_shards = int(window_shards)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.epoch = 0
        self.start = 0  # global position within the epoch: samples consumed by all ranks
        self._reset_epoch_state()
        self._order_cache: tuple[tuple, object] | None = None

    @property
    def shuffle(self) -> bool:
        return self.epoch_mode != "none"

    def _reset_epoch_state(self) -> None:
        self.epoch_mode = self.mode  # the mode of the current epoch (a resumed state may set another)
        self.epoch_window_shards = self.window_shards
        self.segments: list[tuple[int, int]] = [(0, self.num_samples)]  # blocked: unread at the last re-split
        self.segments_position = 0  # blocked: the position at the last re-split

    @property
    def blocked(self) -> bool:
        return self.epoch_mode == "shards"

    # ------------------------------------------------------------- orders
    def order(self, epoch: int | None = None) -> np.ndarray:
        """The global order of ``epoch`` (strided modes only: it is N samples long)."""
        if self.blocked:
            raise ConfigError('order() is the whole permutation; the "shards" mode computes it lazily (block_order())')
        e = self.epoch if epoch is None else int(epoch)
        key = ("flat", e, self.epoch_mode)
        if self._order_cache is not None and self._order_cache[0] == key:
            return self._order_cache[1]
        if self.epoch_mode == "global":
            order = np.random.default_rng([self.seed, e]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        self._order_cache = (key, order)
        return order

    def block_order(self) -> BlockOrder:
        """The block order of the current epoch (shards mode)."""
        key = ("block", self.epoch, self.epoch_window_shards, self.seed)
        if self._order_cache is not None and self._order_cache[0] == key:
            return self._order_cache[1]
        o = BlockOrder(self.shard_sizes, seed=self.seed, epoch=self.epoch, window_shards=self.epoch_window_shards)
        self._order_cache = (key, o)
        return o

    # ------------------------------------------------------------- lengths
    def end_position(self, start: int | None = None) -> int:
        """Global position where the epoch ends, for the current world size."""
        s = self.start if start is None else start
        rest = max(self.num_samples - s, 0)
        w = self.world_size
        per_rank = rest // w if self.drop_last else -(-rest // w)
        return s + per_rank * w

    def local_len(self, start: int | None = None) -> int:
        """Samples this rank reads from ``start`` to the end of the epoch."""
        s = self.start if start is None else start
        return (self.end_position(s) - s) // self.world_size

    def __len__(self) -> int:
        return self.local_len()

    def positions(self) -> np.ndarray:
        """Global positions this rank reads, from ``start`` to the end of the epoch (strided modes)."""
        if self.blocked:
            raise ConfigError('positions() is for the strided modes; "shards" reads blocks (see runs())')
        s = self.start
        return np.arange(s + self.rank, self.end_position(s), self.world_size, dtype=np.int64)

    # ------------------------------------------------------------- blocked split
    def _block(self, rank: int, segments_total: int, world: int) -> tuple[int, int, int]:
        """(first item, real items, block length L) of ``rank``'s block of the concatenated segments."""
        r_total = segments_total
        length = r_total // world if self.drop_last else -(-r_total // world)
        pad = 0 if self.drop_last else length * world - r_total
        full = world - pad  # ranks with L real items; the others have L - 1 and one padding item
        first = rank * length if rank < full else full * length + (rank - full) * (length - 1)
        real = length if rank < full else length - 1
        return first, real, length

    def _item_intervals(self, segments: list[tuple[int, int]], i0: int, i1: int) -> list[tuple[int, int]]:
        """Items [i0, i1) of the concatenated segments as intervals of positions."""
        out, base = [], 0
        for a, b in segments:
            n = b - a
            lo, hi = max(i0, base), min(i1, base + n)
            if lo < hi:
                out.append((a + lo - base, a + hi - base))
            base += n
            if base >= i1:
                break
        return out

    def _local_intervals(self) -> list[tuple[int, int]]:
        """Positions this rank reads from ``start`` to the end of the epoch, as intervals in reading order."""
        if self.epoch_done:
            return []
        total = sum(b - a for a, b in self.segments)
        k = (self.start - self.segments_position) // self.world_size
        first, real, length = self._block(self.rank, total, self.world_size)
        out = self._item_intervals(self.segments, first + min(k, real), first + real)
        if not self.drop_last and real < length and k < length:
            pad = self.rank - (self.world_size - (length * self.world_size - total))
            out.append((pad % self.num_samples, pad % self.num_samples + 1))
        return out

    def _resplit(self, segments: list[tuple[int, int]], world: int, k: int) -> list[tuple[int, int]]:
        """What is left unread of ``segments`` after each of ``world`` ranks read ``k`` items of its block."""
        total = sum(b - a for a, b in segments)
        rest: list[tuple[int, int]] = []
        end = 0
        for r in range(world):
            first, real, _ = self._block(r, total, world)
            rest += self._item_intervals(segments, first + min(k, real), first + real)
            end = max(end, first + real)
        rest += self._item_intervals(segments, end, total)  # a dropped tail
        merged: list[tuple[int, int]] = []
        for a, b in rest:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            elif a < b:
                merged.append((a, b))
        return merged

    # ------------------------------------------------------------- iteration
    def runs(self) -> Iterator[tuple[int, np.ndarray]]:
        """(local offset, sample indices): this rank's rest of the epoch in chunks, from ``start`` now.

        Blocked, one chunk per window (or piece of one); strided, ``_CHUNK``
        samples. The position is read when this is called, not when iterated.
        """
        if self.blocked:
            return self._block_runs(self._local_intervals(), self.block_order())
        return self._strided_runs(self.order(), self.start, self.end_position())

    @staticmethod
    def _block_runs(intervals: list[tuple[int, int]], order: BlockOrder) -> Iterator[tuple[int, np.ndarray]]:
        off = 0
        for a, b in intervals:
            p = a
            while p < b:
                w = int(order.window_of(np.int64(p)))
                q = min(b, int(order.window_starts[w + 1]))
                yield off, order.samples(np.arange(p, q, dtype=np.int64))
                off += q - p
                p = q

    def _strided_runs(self, order: np.ndarray, s: int, end: int) -> Iterator[tuple[int, np.ndarray]]:
        w, n, off = self.world_size, self.num_samples, 0
        for p0 in range(s + self.rank, end, _CHUNK * w):
            pos = np.arange(p0, min(p0 + _CHUNK * w, end), w, dtype=np.int64)
            yield off, order[pos % n]
            off += len(pos)

    def __iter__(self) -> Iterator[int]:
        return (i for _, samples in self.runs() for i in samples.tolist())

    def shard_schedule(self) -> Iterator[tuple[int, int, int]]:
        """(shard, first, last): the shards this rank reads from ``start`` now, in order of first use.

        ``first``/``last`` are local offsets (samples into the rest of this
        rank's epoch) of the shard's first and last use in a chunk; in the
        strided modes a shard is reported once, with ``last`` the epoch's end.
        Needs ``shard_sizes``. Lazy (a window at a time) and safe to walk in
        another thread than the one iterating the sampler (its own BlockOrder).
        """
        if self.shard_sizes is None:
            raise ConfigError("shard_schedule() needs shard_sizes")
        if self.blocked:
            order = BlockOrder(self.shard_sizes, seed=self.seed, epoch=self.epoch, window_shards=self.epoch_window_shards)
            runs = self._block_runs(self._local_intervals(), order)
        else:
            runs = self._strided_runs(self.order(), self.start, self.end_position())
        return self._schedule(runs, self.blocked, self.local_len())

    def _schedule(self, runs, blocked: bool, end: int) -> Iterator[tuple[int, int, int]]:
        starts = np.concatenate([[0], np.cumsum(self.shard_sizes)[:-1]])
        seen: set[int] = set()
        for off, samples in runs:
            shards = np.searchsorted(starts, samples, side="right") - 1
            ids, first = np.unique(shards, return_index=True)
            _, last_rev = np.unique(shards[::-1], return_index=True)
            last = len(shards) - 1 - last_rev
            for j in np.argsort(first, kind="stable").tolist():
                s = int(ids[j])
                if blocked:
                    yield s, off + int(first[j]), off + int(last[j])
                elif s not in seen:
                    seen.add(s)
                    yield s, off + int(first[j]), end

    # ------------------------------------------------------------- epochs and state
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; a no-op while inside it (a resumed epoch keeps its position)."""
        if int(epoch) != self.epoch or self.epoch_done:
            self.epoch = int(epoch)
            self.start = 0
            self._reset_epoch_state()

    def advance(self, local_samples: int) -> None:
        """Record that every rank consumed ``local_samples`` more samples."""
        self.start = min(self.start + int(local_samples) * self.world_size, self.end_position())

    @property
    def epoch_done(self) -> bool:
        return self.start >= self.end_position()

    def _shards_crc32(self) -> int:
        return zlib.crc32(self.shard_sizes.astype("<i8").tobytes()) if self.shard_sizes is not None else 0

    def state_dict(self, *, roll_over: bool = False) -> dict:
        """The resume state; with ``roll_over``, a finished epoch is saved as the start of the next."""
        if roll_over and self.epoch_done:
            epoch, position, mode = self.epoch + 1, 0, self.mode
            segments, seg_pos, window = [(0, self.num_samples)], 0, self.window_shards
        else:
            epoch, position, mode = self.epoch, self.start, self.epoch_mode
            segments, seg_pos, window = self.segments, self.segments_position, self.epoch_window_shards
        state = {
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "shuffle": mode,
        }
        if mode == "shards":
            state |= {
                "window_shards": window,
                "num_shards": len(self.shard_sizes),
                "shards_crc32": self._shards_crc32(),
                "segments": [[int(a), int(b)] for a, b in segments],
                "segments_position": seg_pos,
            }
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume at (epoch, position). Seed and mode come from the state; the world size may differ.

        A version-1 state (before block shuffling) resumes its epoch in the
        order it was saved in ("global" or "none").
        """
        version = int(state.get("version", 1))
        if version not in (1, STATE_VERSION):
            raise ConfigError(f"sampler state version {version} is not one this slipstream reads (1 or {STATE_VERSION}): saved by a newer release?")
        if int(state["num_samples"]) != self.num_samples:
            raise ConfigError(
                f"sampler state is for num_samples({int(state['num_samples'])}) but the dataset has {self.num_samples}: "
                "the dataset changed, so the saved order cannot be resumed"
            )
        mode = state.get("shuffle", self.mode != "none")
        mode = ("global" if mode else "none") if isinstance(mode, bool) else str(mode)
        if mode not in MODES:
            raise ConfigError(f"sampler state has shuffle={mode!r}, not one of {MODES}")
        saved_world = int(state.get("world_size", 1))
        if mode == "shards":
            if self.shard_sizes is None or int(state["num_shards"]) != len(self.shard_sizes) or int(state["shards_crc32"]) != self._shards_crc32():
                raise ConfigError(
                    f"sampler state is for {int(state['num_shards'])} shards of other sizes than this dataset's "
                    f"{0 if self.shard_sizes is None else len(self.shard_sizes)}: the dataset changed, so the saved order cannot be resumed"
                )
        position = int(state["position"])
        limit = self.num_samples + saved_world - 1  # an epoch ends at most W-1 positions past N (padding)
        if not 0 <= position <= limit:
            raise ConfigError(f"sampler state position {position} is outside [0, {limit}] for {self.num_samples} samples")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.start = position
        self._reset_epoch_state()
        self.epoch_mode = mode
        self._order_cache = None
        if mode != "shards":
            return
        self.epoch_window_shards = int(state["window_shards"])
        segments = [(int(a), int(b)) for a, b in state["segments"]]
        seg_pos = int(state["segments_position"])
        if seg_pos + sum(b - a for a, b in segments) != self.num_samples or not seg_pos <= position:
            raise ConfigError(f"sampler state segments do not add up: position {seg_pos} + unread {sum(b - a for a, b in segments)} != {self.num_samples}")
        if saved_world != self.world_size and position < self.num_samples:
            segments = self._resplit(segments, saved_world, (position - seg_pos) // saved_world)
            seg_pos = position
        self.segments, self.segments_position = segments, seg_pos
