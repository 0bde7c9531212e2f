"""ShardedDataset: a map-style torch Dataset over packed shards, local or remote."""

from __future__ import annotations

import bisect
import os
import threading
from typing import Any, Mapping

import torch.utils.data

from ..errors import ConfigError
from .cache import ShardCache, load_index
from .format import DataIntegrityError, ShardReader, decode
from .source import Source

ON_ERROR = ("raise", "skip")


class SkippedSample:
    """Stands in for a sample that failed its checks when ``on_error="skip"``.

    The loader's collate drops it and counts it; it never reaches the model.
    """

    __slots__ = ("error",)

    def __init__(self, error: DataIntegrityError):
        self.error = str(error)

    def __repr__(self) -> str:
        return f"SkippedSample({self.error!r})"


class ShardedDataset(torch.utils.data.Dataset):
    """Samples of a packed dataset by global index, read through memory maps.

    ``source`` is a local directory (read in place) or an fsspec URL (shards
    are fetched into ``cache`` on first use, or by ``prewarm`` ahead of time).
    Shards open lazily, once per process, so data-loader workers each map
    what they read. Every read checks the sample's CRC-32.

    ``on_error="raise"`` (default) raises DataIntegrityError naming the shard
    and byte offset; ``"skip"`` returns a SkippedSample instead, which the
    loader drops and counts (``SlipstreamLoader.skipped_total``).

    Example::

        ds = ShardedDataset("s3://bucket/tokens", cache=ShardCache("/nvme/cache"))
        tokens = ds[0]          # numpy array for one-field datasets, bytes for raw ones
    """

    def __init__(
        self,
        source: str | os.PathLike,
        *,
        cache: ShardCache | str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        on_error: str = "raise",
        verify_samples: bool = True,
    ):
        if on_error not in ON_ERROR:
            raise ConfigError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        self.source = Source(str(source), storage_options)
        if isinstance(cache, (str, os.PathLike)):
            cache = ShardCache(cache)
        if cache is None and not self.source.is_local:
            raise ConfigError(f"{self.source.url} is not a local path: pass cache= (a ShardCache or a directory) to read it")
        self.cache = cache
        self.on_error = on_error
        self.verify_samples = verify_samples
        self.index = load_index(self.source) if self.cache is None else self.cache.load_index(self.source)
        self.fields = self.index.fields
        self._starts = self.index.starts().tolist()
        self._readers: dict[int, ShardReader] = {}
        self._bad_shards: dict[int, DataIntegrityError] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_readers"] = {}  # memory maps are reopened in each worker process
        d["_bad_shards"] = {}
        d["_lock"] = None
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.index.num_samples

    @property
    def num_shards(self) -> int:
        return len(self.index.shards)

    def locate(self, i: int) -> tuple[int, int]:
        """Global sample index -> (shard number, index within the shard)."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range [0, {len(self)})")
        s = bisect.bisect_right(self._starts, i) - 1
        return s, i - self._starts[s]

    def shard(self, s: int) -> ShardReader:
        r = self._readers.get(s)
        if r is not None:
            return r
        if s in self._bad_shards:
            raise self._bad_shards[s]
        with self._lock:
            r = self._readers.get(s)
            if r is None:
                info = self.index.shards[s]
                try:
                    if self.source.is_local:
                        path = self.source.local_path(info.file)
                        if not os.path.exists(path):
                            raise DataIntegrityError(f"{path}: shard listed in the index is missing", shard=path, offset=0)
                        r = ShardReader(path, info)
                    else:
                        r = self.cache.open(self.source, info)
                except DataIntegrityError as exc:
                    self._bad_shards[s] = exc
                    raise
                self._readers[s] = r
        return r

    def raw(self, i: int) -> memoryview:
        """The checked bytes of sample ``i`` (a view into the memory map)."""
        s, j = self.locate(i)
        return self.shard(s).sample(j, verify=self.verify_samples)

    def __getitem__(self, i: int) -> Any:
        i = int(i)
        try:
            return decode(self.raw(i), self.fields)
        except DataIntegrityError as exc:
            if self.on_error == "skip":
                return SkippedSample(exc)
            raise

    def key(self, i: int) -> str:
        if self.index.keys is None:
            raise ConfigError("this dataset was packed without keys")
        return self.index.keys[i]

    def close(self) -> None:
        self._readers.clear()

    def __repr__(self) -> str:
        return f"ShardedDataset({self.source.url!r}, samples={len(self)}, shards={self.num_shards})"


def verify_dataset(source: str, *, cache: ShardCache | None = None, storage_options=None) -> list[DataIntegrityError]:
    """Check every shard of a dataset (whole-file SHA-256, structure, every sample's CRC).

    Returns the errors found (empty when the dataset is sound).

    Example::

        bad = verify_dataset("/data/tokens")
        assert not bad, bad
    """
    from .format import file_sha256

    ds = ShardedDataset(source, cache=cache, storage_options=storage_options)
    errors: list[DataIntegrityError] = []
    for s, info in enumerate(ds.index.shards):
        try:
            r = ds.shard(s)
            if ds.source.is_local:
                digest = file_sha256(r.path)
                if digest != info.sha256:
                    errors.append(DataIntegrityError(f"{r.name}: sha256 {digest} does not match the index ({info.sha256})", shard=r.name))
            for j in range(r.num_samples):
                r.sample(j, verify=True)
        except DataIntegrityError as exc:
            errors.append(exc)
    return errors
