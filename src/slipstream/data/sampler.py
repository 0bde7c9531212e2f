"""ResumableSampler: a deterministic, rank-sharded order that resumes mid-epoch.

The order of epoch ``e`` is a permutation of all samples drawn from
``numpy.random.default_rng([seed, e])`` (PCG64: the same on every platform and
numpy version that keeps the stream stable), or ``0..N-1`` without shuffling.
Positions run over that global order; position ``p`` names sample
``order[p % N]``, so the tail of an epoch that does not divide evenly among the
ranks wraps around to its start (every rank gets the same number of samples,
which DDP needs), unless ``drop_last`` drops that tail instead.

From a start position ``s`` rank ``r`` of ``W`` reads positions
``s + r, s + r + W, s + r + 2W, ...``. After each rank consumed ``k`` samples,
the global position is ``s + k*W``; that single number, with the epoch, is the
resume state. Resuming at it with the same ``W`` gives every rank exactly the
samples it would have read next.

**When the world size changes** (a job resumes on more or fewer ranks): the
global position is kept and the rest of the epoch's order is re-split among
the new ranks. No sample of the epoch is skipped or read twice, except the
wrap-around padding at the very end, which is computed for the new ``W``. The
next epoch is the same permutation whatever the world size, split among the
new ranks.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch.utils.data

from ..errors import ConfigError

STATE_VERSION = 1


def dist_rank_world() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when initialised, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableSampler(torch.utils.data.Sampler[int]):
    """Deterministic per (seed, epoch), split across ranks, resumable from (epoch, position).

    ``rank`` and ``world_size`` default to torch.distributed's. The sampler
    yields this rank's indices from ``start`` to the end of ``epoch``; the
    consumer (``SlipstreamLoader``) advances ``start`` by what the training loop
    actually consumed, because a data loader reads ahead of the loop.

    Example::

        s = ResumableSampler(len(ds), seed=0, rank=0, world_size=2)
        s.set_epoch(3)
        s.start = 1000          # global position: 500 samples per rank already read
        first = next(iter(s))  # what rank 0 reads next
    """

    def __init__(
        self,
        num_samples: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
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
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.epoch = 0
        self.start = 0  # global position within the epoch
        self._order_cache: tuple[int, np.ndarray] | None = None

    # ------------------------------------------------------------- order
    def order(self, epoch: int | None = None) -> np.ndarray:
        """The global order of ``epoch`` (all ranks)."""
        e = self.epoch if epoch is None else int(epoch)
        if self._order_cache is not None and self._order_cache[0] == e:
            return self._order_cache[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, e]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        self._order_cache = (e, order)
        return order

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
        """Global positions this rank reads, from ``start`` to the end of the epoch."""
        s = self.start
        return np.arange(s + self.rank, self.end_position(s), self.world_size, dtype=np.int64)

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        for p in self.positions().tolist():
            yield int(order[p % self.num_samples])

    # ------------------------------------------------------------- epochs and state
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning; a no-op while inside it (a resumed epoch keeps its position)."""
        if int(epoch) != self.epoch or self.epoch_done:
            self.epoch = int(epoch)
            self.start = 0

    def advance(self, local_samples: int) -> None:
        """Record that every rank consumed ``local_samples`` more samples."""
        self.start = min(self.start + int(local_samples) * self.world_size, self.end_position())

    @property
    def epoch_done(self) -> bool:
        return self.start >= self.end_position()

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "position": self.start,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at (epoch, position). The seed comes from the state; the world size may differ."""
        if int(state.get("version", STATE_VERSION)) != STATE_VERSION:
            raise ConfigError(f"sampler state version {state.get('version')} is not {STATE_VERSION}")
        if int(state["num_samples"]) != self.num_samples:
            raise ConfigError(
                f"sampler state is for num_samples({int(state['num_samples'])}) but the dataset has {self.num_samples}: "
                "the dataset changed, so the saved order cannot be resumed"
            )
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.epoch = int(state["epoch"])
        self.start = int(state["position"])
        self._order_cache = None
        # An epoch ends at most W-1 positions past N (the wrap-around padding of the saving run).
        limit = self.num_samples + int(state.get("world_size", 1)) - 1
        if not 0 <= self.start <= limit:
            raise ConfigError(f"sampler state position {self.start} is outside [0, {limit}] for {self.num_samples} samples")
