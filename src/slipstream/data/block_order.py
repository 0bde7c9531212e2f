"""BlockOrder: the shard-aware order of one epoch, computed lazily.

The order of epoch ``e`` over ``S`` shards of sizes ``n_0 .. n_{S-1}``:

1. the shards are permuted with ``numpy.random.default_rng([seed, e])``;
2. the permuted shard sequence is cut into windows of ``window_shards``
   consecutive shards (the last window may hold fewer);
3. the samples of window ``w`` (its shards' samples, concatenated in the
   permuted shard order) are permuted with ``default_rng([seed, e, w])``.

Position ``p`` of the epoch is the ``p``-th sample of that sequence of
shuffled windows. Memory: the shard permutation and its prefix sums (O(S)),
plus the permutation of the one or two windows being read (O(window)); never
anything of the size of the dataset. A position maps to its sample with two
binary searches and one lookup in the window's permutation.

Example::

    o = BlockOrder(np.array([10, 10, 5]), seed=0, epoch=0, window_shards=2)
    o.samples(np.arange(25))        # every sample of the epoch once
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError

_KEEP_WINDOWS = 2  # the window being read and the next one (a chunk may straddle them)


class BlockOrder:
    """Position -> sample of one epoch in the block-shuffled order (see the module docstring)."""

    def __init__(self, shard_sizes: np.ndarray, *, seed: int, epoch: int, window_shards: int, shuffle: bool = True):
        if window_shards < 1:
            raise ConfigError(f"window_shards must be at least 1, got {window_shards}")
        sizes = np.asarray(shard_sizes, dtype=np.int64)
        self.seed, self.epoch, self.window_shards, self.shuffle = int(seed), int(epoch), int(window_shards), bool(shuffle)
        s = len(sizes)
        # global sample index of each shard's first sample (shards in index order)
        self.shard_starts = np.zeros(s, dtype=np.int64)
        np.cumsum(sizes[:-1], out=self.shard_starts[1:])
        self.shard_order = np.random.default_rng([self.seed, self.epoch]).permutation(s) if shuffle else np.arange(s)
        # position where the j-th shard of the epoch's shard order starts (S + 1 entries)
        self.pos_starts = np.zeros(s + 1, dtype=np.int64)
        np.cumsum(sizes[self.shard_order], out=self.pos_starts[1:])
        self.num_samples = int(self.pos_starts[-1])
        bounds = list(range(0, s, self.window_shards)) + [s]
        self.window_starts = self.pos_starts[bounds]  # position where each window starts, + the end
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_windows(self) -> int:
        return len(self.window_starts) - 1

    def window_of(self, positions: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.window_starts, positions, side="right") - 1

    def window_perm(self, w: int) -> np.ndarray:
        """The permutation of window ``w``'s samples (kept for the last two windows asked for)."""
        perm = self._perms.get(w)
        if perm is None:
            n = int(self.window_starts[w + 1] - self.window_starts[w])
            if self.shuffle:
                perm = np.random.default_rng([self.seed, self.epoch, w]).permutation(n)
            else:
                perm = np.arange(n, dtype=np.int64)
            if len(self._perms) >= _KEEP_WINDOWS:
                self._perms.pop(next(iter(self._perms)))
            self._perms[w] = perm
        return perm

    def samples(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices at ``positions`` (each in [0, num_samples))."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty_like(positions)
        if positions.size == 0:
            return out
        wins = self.window_of(positions)
        for w in np.unique(wins).tolist():
            sel = wins == w
            base = self.window_starts[w]
            # position in the window's unshuffled concatenation of shards
            c = self.window_perm(w)[positions[sel] - base] + base
            j = np.searchsorted(self.pos_starts, c, side="right") - 1
            out[sel] = self.shard_starts[self.shard_order[j]] + (c - self.pos_starts[j])
        return out
