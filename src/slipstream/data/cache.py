"""Node-local shard cache: content-addressed, safe under many processes, LRU-limited.

Layout under the cache directory::

    blobs/<sha256>.slp      complete, verified shards (named by their SHA-256)
    tmp/<sha256>.<pid>.<n>  downloads in progress
    locks/<sha256>.lock     one file lock per shard: one downloader, the rest wait
    cache.lock              taken while evicting
    indexes/<hash>.json     the last index read from each dataset URL (used when the store is unreachable)

Rules that make it safe when several processes and data-loader workers share it:

* a blob appears only by ``os.replace`` of a fully downloaded file whose size
  and SHA-256 match the index, so a reader sees a whole verified shard or none;
* naming by hash means a changed source shard is a different blob: stale bytes
  are never served;
* before a download, room is reserved under ``cache.lock``: least-recently-used
  blobs (mtime, bumped on every open) are deleted until the shard fits under
  ``max_bytes`` together with the reservations of downloads in flight (marker
  files in ``tmp/``), so parallel downloads do not overshoot the limit. A process that has a shard
  mapped keeps reading it after eviction (POSIX keeps unlinked files alive
  while mapped); one that loses the race between lookup and open downloads it
  again;
* temporary files of processes that died are removed on the next eviction
  pass (by pid on the same host and pid namespace, by age otherwise).

Example::

    cache = ShardCache("/local/cache", max_bytes=50 << 30)
    report = prewarm("s3://bucket/tokens", cache, workers=16)
    ds = ShardedDataset("s3://bucket/tokens", cache=cache)
"""

from __future__ import annotations

import hashlib
import itertools
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from filelock import FileLock

from ..errors import ConfigError
from ..resilience.pids import alive
from .format import INDEX_NAME, DataIntegrityError, Index, ShardInfo, ShardReader, file_sha256
from .source import Source, SourceUnavailable

_counter = itertools.count()
# Host (and pid namespace) of this process, for telling whose temporary files are whose.
_HOST_ID = hashlib.sha256(f"{socket.gethostname()}:{os.stat('/proc/self/ns/pid').st_ino if os.path.exists('/proc/self/ns/pid') else 0}".encode()).hexdigest()[:12]
STALE_TMP_S = 3600.0


def _tmp_name(sha256: str) -> str:
    return f"{sha256}.{os.getpid()}.{next(_counter)}.{_HOST_ID}"


@dataclass
class CacheStats:
    """Counters of one ShardCache object (per process: each loader worker has its own)."""

    hits: int = 0
    downloads: int = 0
    bytes_downloaded: int = 0
    evictions: int = 0
    bytes_evicted: int = 0
    checksum_failures: int = 0
    index_fallbacks: int = 0
    download_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class ShardCache:
    """A directory of verified shards shared by every process on the node.

    ``max_bytes`` limits the blobs kept (None: no limit). ``retries`` is how
    many times a download whose checksum fails is tried again before the
    DataIntegrityError is raised.

    Example::

        cache = ShardCache("/nvme/cache", max_bytes=50 << 30)
        path = cache.fetch(Source("s3://bucket/tokens"), index.shards[0])   # verified local copy
        print(cache.stats.hits, cache.stats.downloads)
    """

    def __init__(self, cache_dir: str | os.PathLike, max_bytes: int | None = None, *, retries: int = 2):
        if max_bytes is not None and max_bytes <= 0:
            raise ConfigError(f"max_bytes must be positive or None, got {max_bytes}")
        self.dir = os.path.abspath(os.path.expanduser(str(cache_dir)))
        self.max_bytes = max_bytes
        self.retries = int(retries)
        for sub in ("blobs", "tmp", "locks"):
            os.makedirs(os.path.join(self.dir, sub), exist_ok=True)
        self.stats = CacheStats()

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["stats"] = CacheStats()  # a worker counts its own
        return d

    def blob_path(self, sha256: str) -> str:
        return os.path.join(self.dir, "blobs", f"{sha256}.slp")

    def contains(self, info: ShardInfo) -> bool:
        return os.path.exists(self.blob_path(info.sha256))

    def used_bytes(self) -> int:
        return sum(size for _, size, _ in self._blobs())

    # ----------------------------------------------------------------- fetch
    def fetch(self, source: Source, info: ShardInfo, on_bytes: Callable[[int], None] | None = None) -> str:
        """Local path of a verified copy of shard ``info`` from ``source``; downloads on a miss."""
        path = self.blob_path(info.sha256)
        if self._touch(path):
            self.stats.add(hits=1)
            return path
        with FileLock(os.path.join(self.dir, "locks", f"{info.sha256}.lock")):
            if self._touch(path):  # another process fetched it while we waited
                self.stats.add(hits=1)
                return path
            reservation = self._reserve(info.size_bytes, info.sha256)
            try:
                return self._download(source, info, path, on_bytes)
            finally:
                _remove(reservation)

    def _download(self, source: Source, info: ShardInfo, path: str, on_bytes: Callable[[int], None] | None) -> str:
        url = source.join(info.file)
        problem = ""
        for _ in range(self.retries + 1):
            tmp = os.path.join(self.dir, "tmp", _tmp_name(info.sha256))
            t0 = time.perf_counter()
            try:
                source.get_file(info.file, tmp)
                size = os.path.getsize(tmp)
                digest = file_sha256(tmp) if size == info.size_bytes else None
            except BaseException:
                _remove(tmp)
                raise
            self.stats.add(download_s=time.perf_counter() - t0, bytes_downloaded=size)
            if size == info.size_bytes and digest == info.sha256:
                os.replace(tmp, path)
                self.stats.add(downloads=1)
                if on_bytes is not None:
                    on_bytes(size)
                return path
            _remove(tmp)
            self.stats.add(checksum_failures=1)
            if size != info.size_bytes:
                problem = f"{size} bytes arrived, the index says {info.size_bytes} (truncated at byte offset {min(size, info.size_bytes)})"
            else:
                problem = f"sha256 of the bytes that arrived is {digest}, the index says {info.sha256}"
        raise DataIntegrityError(
            f"{url}: checksum failure on arrival after {self.retries + 1} tries: {problem}",
            shard=url,
            offset=None,
        )

    def open(self, source: Source, info: ShardInfo) -> ShardReader:
        """A memory-mapped reader of the cached shard (fetching it if needed)."""
        damaged = 0
        for _ in range(3):
            path = self.fetch(source, info)
            try:
                return ShardReader(path, info, name=f"{source.join(info.file)} (cached as {path})")
            except FileNotFoundError:
                continue  # evicted by another process between fetch and open: fetch again
            except DataIntegrityError:
                # The cached copy was damaged after it arrived (disk, a stray writer):
                # drop it and fetch a fresh one, once.
                if damaged:
                    raise
                damaged += 1
                self.stats.add(checksum_failures=1)
                _remove(path)
        raise DataIntegrityError(f"{source.join(info.file)}: evicted three times while opening; raise max_bytes", shard=source.join(info.file))

    # ------------------------------------------------------------- eviction
    def _blobs(self) -> list[tuple[float, int, str]]:
        out = []
        bdir = os.path.join(self.dir, "blobs")
        for name in os.listdir(bdir):
            p = os.path.join(bdir, name)
            try:
                st = os.stat(p)
            except FileNotFoundError:
                continue
            out.append((st.st_mtime, st.st_size, p))
        return out

    def _reserve(self, need: int, sha256: str, timeout_s: float = 600.0) -> str:
        """Make room for ``need`` bytes (evicting LRU blobs) and hold it with a marker file.

        Markers ``tmp/<sha>.<pid>.<n>.reserve-<bytes>`` count against the limit
        until the download lands, so parallel downloads cannot overshoot it.
        When in-flight downloads alone fill the cache, wait for them.
        """
        marker = os.path.join(self.dir, "tmp", f"{_tmp_name(sha256)}.reserve-{need}")
        if self.max_bytes is None:
            return marker
        if need > self.max_bytes:
            raise ConfigError(f"a shard of {need} bytes does not fit in a cache limited to max_bytes={self.max_bytes}")
        deadline = time.monotonic() + timeout_s
        while True:
            with FileLock(os.path.join(self.dir, "cache.lock")):
                self._remove_dead_tmp()
                reserved = self._reserved_bytes()
                blobs = sorted(self._blobs())  # oldest first
                total = reserved + sum(size for _, size, _ in blobs)
                for _, size, p in blobs:
                    if total + need <= self.max_bytes:
                        break
                    _remove(p)
                    total -= size
                    self.stats.add(evictions=1, bytes_evicted=size)
                if total + need <= self.max_bytes:
                    open(marker, "wb").close()
                    return marker
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"no room for {need} bytes in the cache (max_bytes={self.max_bytes}) after {timeout_s:.0f} s: "
                    "downloads in flight fill it; raise max_bytes or use fewer workers"
                )
            time.sleep(0.05)

    def _reserved_bytes(self) -> int:
        total = 0
        for name in os.listdir(os.path.join(self.dir, "tmp")):
            _, sep, size = name.rpartition(".reserve-")
            if sep and size.isdigit():
                total += int(size)
        return total

    def evict_to(self, max_bytes: int) -> int:
        """Delete least-recently-used blobs until at most ``max_bytes`` remain; returns bytes freed."""
        freed = 0
        with FileLock(os.path.join(self.dir, "cache.lock")):
            blobs = sorted(self._blobs())
            total = sum(size for _, size, _ in blobs)
            for _, size, p in blobs:
                if total <= max_bytes:
                    break
                _remove(p)
                total -= size
                freed += size
                self.stats.add(evictions=1, bytes_evicted=size)
        return freed

    def _remove_dead_tmp(self) -> None:
        """Drop temporary files and reservations of processes that died.

        Names carry (pid, host). A pid is only meaningful on its own host (and
        pid namespace): entries of other hosts, or unparsable ones, go once they
        have not been written for ``STALE_TMP_S``.
        """
        tdir = os.path.join(self.dir, "tmp")
        now = time.time()
        for name in os.listdir(tdir):
            path = os.path.join(tdir, name)
            parts = name.split(".")
            try:
                pid, host = int(parts[1]), parts[3]
            except (IndexError, ValueError):
                pid, host = -1, ""
            if host == _HOST_ID and pid > 0:
                if pid != os.getpid() and not alive(pid):
                    _remove(path)
                continue
            try:
                if now - os.stat(path).st_mtime > STALE_TMP_S:
                    _remove(path)
            except FileNotFoundError:
                pass

    @staticmethod
    def _touch(path: str) -> bool:
        try:
            os.utime(path)  # LRU clock: mtime = last use
            return True
        except FileNotFoundError:
            return False
        except PermissionError:  # a cache filled by another user: usable, not ours to reorder
            return os.path.exists(path)

    # ------------------------------------------------------------- index
    def load_index(self, source: Source) -> Index:
        """The dataset's index from the store, kept here too.

        When the store cannot be reached (SourceUnavailable) and an earlier copy
        is kept, that copy is used with a warning: the shards it names are
        addressed by hash, so it can only lead to verified bytes (or to a clear
        error for a shard not cached).
        """
        kept = os.path.join(self.dir, "indexes", hashlib.sha256(source.url.encode()).hexdigest()[:32] + ".json")
        where = source.join(INDEX_NAME)
        try:
            data = source.read_bytes(INDEX_NAME)
        except SourceUnavailable as exc:
            if not os.path.exists(kept):
                raise
            warnings.warn(f"{exc}; using the copy of its index kept at {kept}", stacklevel=2)
            self.stats.add(index_fallbacks=1)
            with open(kept, "rb") as f:
                return Index.loads(f.read(), where=f"{kept} (copy of {where})")
        index = Index.loads(data, where=where)
        os.makedirs(os.path.dirname(kept), exist_ok=True)
        tmp = f"{kept}.{_tmp_name('index')}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, kept)
        return index

    def __repr__(self) -> str:
        return f"ShardCache({self.dir!r}, max_bytes={self.max_bytes})"


# ----------------------------------------------------------------- prewarm


@dataclass
class PrewarmReport:
    url: str
    shards: int
    already_cached: int
    downloaded: int
    bytes_downloaded: int
    seconds: float
    evicted: int = 0

    @property
    def throughput_mb_s(self) -> float:
        return self.bytes_downloaded / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.url}: {self.shards} shards, {self.already_cached} already cached, "
            f"{self.downloaded} downloaded ({self.bytes_downloaded / 1e6:.1f} MB in {self.seconds:.2f} s, "
            f"{self.throughput_mb_s:.1f} MB/s)"
            + (f"; {self.evicted} evicted to stay under the cache limit: the dataset does not fit" if self.evicted else "")
        )


def load_index(source: Source) -> Index:
    return Index.loads(source.read_bytes(INDEX_NAME), where=source.join(INDEX_NAME))


def prewarm(
    url: str,
    cache: ShardCache,
    *,
    workers: int = 8,
    storage_options: Mapping[str, Any] | None = None,
    progress: bool = True,
) -> PrewarmReport:
    """Download every shard of the dataset at ``url`` into ``cache``, ``workers`` at a time.

    Shards already cached are skipped; each download is verified before it
    becomes visible. A rich progress bar (bytes, speed) goes to stderr.

    Example::

        report = prewarm("s3://bucket/tokens", ShardCache("/nvme/cache"), workers=16)
        print(report.summary())
    """
    from concurrent.futures import ThreadPoolExecutor

    if workers < 1:
        raise ConfigError(f"workers must be at least 1, got {workers}")
    source = Source(url, storage_options)
    index = cache.load_index(source)
    todo = [s for s in index.shards if not cache.contains(s)]
    cached = len(index.shards) - len(todo)
    todo_bytes = sum(s.size_bytes for s in todo)
    t0 = time.perf_counter()
    before = cache.stats.downloads, cache.stats.bytes_downloaded, cache.stats.evictions

    def run(advance: Callable[[int], None]) -> None:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slipstream-prewarm") as pool:
            futures = [pool.submit(cache.fetch, source, s, advance) for s in todo]
            for f in futures:
                f.result()

    if progress and todo:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        with Progress(
            TextColumn("prewarm"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            transient=False,
        ) as bar:
            task = bar.add_task("prewarm", total=todo_bytes)
            lock = threading.Lock()

            def advance(n: int) -> None:
                with lock:
                    bar.advance(task, n)

            run(advance)
    else:
        run(lambda n: None)
    return PrewarmReport(
        url=source.url,
        shards=len(index.shards),
        already_cached=cached,
        downloaded=cache.stats.downloads - before[0],
        bytes_downloaded=cache.stats.bytes_downloaded - before[1],
        seconds=time.perf_counter() - t0,
        evicted=cache.stats.evictions - before[2],
    )


# ----------------------------------------------------------------- helpers


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


    return True
