"""SlipstreamLoader: DataLoader + resumable sampler + background prefetch + wait timing.

Reading overlaps compute twice over: ``num_workers`` processes read and
collate batches ahead (torch's DataLoader, ``prefetch_factor`` each), and a
background thread keeps ``prefetch_batches`` finished batches queued (with
``num_workers=0`` that thread is the only overlap; with ``pin_memory`` it also
hides the pinning). The time the training loop blocks in ``next()`` is the
data wait: ``last_wait_s`` for the last step, ``wait_s_total`` since creation,
and ``stats()`` for the metrics recorder (``recorder.sources.append(loader.stats)``).

Resume: ``state_dict()`` is (epoch, global position) of the samples handed to
the training loop, not of what the workers have read ahead, so saving it with
the model after a step and loading it later gives exactly the batches that
would have come next, with any ``num_workers``. A batch counts as consumed once
``next()`` returned it.

Example::

    ds = ShardedDataset("s3://bucket/tokens", cache="/nvme/cache")
    loader = SlipstreamLoader(ds, batch_size=8, seed=0, num_workers=2)
    loader.load_state_dict(ckpt["data"])          # optional: resume mid-epoch
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)                     # no-op when resuming inside it
        for batch in loader:
            step(batch)
            recorder.add("data_wait_s", loader.last_wait_s)
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch.utils.data
from torch.utils.data import default_collate

from ..errors import ConfigError
from ..process.runtime import detect_launch_env
from .dataset import ShardedDataset, SkippedSample
from .sampler import DEFAULT_WINDOW_SHARDS, ResumableSampler

_KEEP_ERRORS = 8


class _Collated:
    """A collated batch plus how many samples it stood for and how many were skipped."""

    __slots__ = ("data", "n", "skipped", "errors")

    def __init__(self, data: Any, n: int, skipped: int, errors: list[str]):
        self.data, self.n, self.skipped, self.errors = data, n, skipped, errors

    def pin_memory(self, device: Any = None) -> "_Collated":  # called by DataLoader's pinning (accelerators only)
        return _Collated(pin_batch(self.data) if self.data is not None else None, self.n, self.skipped, self.errors)


def pin_batch(data: Any) -> Any:
    """``data`` with every tensor in page-locked (pinned) memory, each container kept as its own type.

    What ``SlipstreamLoader(pin_memory=True)`` does to each batch when an accelerator
    is present. torch's own walk (``torch.utils.data._utils.pin_memory``) returns a
    dataclass untouched, so a batch that a ``collate_fn`` builds as a dataclass kept its
    tensors in pageable memory, and the training loop's ``.to("cuda", non_blocking=True)``
    silently became a synchronous copy. This walk is torch's (tensors, an object's own
    ``pin_memory()``, mappings, namedtuples, tuples, sequences; anything else as it is)
    plus dataclasses, at any depth: a shallow copy of the same class with every field
    pinned, ``init=False`` fields included, ``__post_init__`` not run again. Needs an
    accelerator (pinning is a device feature).

    Example::

        pin_batch({"tokens": Batch(ids=torch.ones(8, 128)), "step": 3})   # same structure, pinned tensors
    """
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    if hasattr(data, "pin_memory") and not isinstance(data, type):  # a batch class that pins itself
        return data.pin_memory()
    if isinstance(data, (str, bytes)):
        return data
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        clone = copy.copy(data)
        for f in dataclasses.fields(data):
            object.__setattr__(clone, f.name, pin_batch(getattr(data, f.name)))  # frozen ones too
        return clone
    if isinstance(data, collections.abc.Mapping):
        pinned = {k: pin_batch(v) for k, v in data.items()}
        try:
            if isinstance(data, collections.abc.MutableMapping):  # keeps the mapping's class and attributes
                clone = copy.copy(data)
                clone.update(pinned)
                return clone
            return type(data)(pinned)
        except TypeError:  # a mapping that cannot be copied or built from a dict
            return pinned
    if isinstance(data, tuple):
        if hasattr(data, "_fields"):  # a namedtuple
            return type(data)(*(pin_batch(v) for v in data))
        return type(data)(pin_batch(v) for v in data)
    if isinstance(data, collections.abc.Sequence):
        items = [pin_batch(v) for v in data]
        try:
            if isinstance(data, collections.abc.MutableSequence):
                clone = copy.copy(data)
                for i, item in enumerate(items):
                    clone[i] = item
                return clone
            return type(data)(items)
        except TypeError:  # e.g. a range
            return items
    return data


class _CountingCollate:
    """Drops SkippedSample stand-ins, counts them, collates the rest (runs in workers)."""

    def __init__(self, collate_fn: Callable[[list], Any]):
        self.collate_fn = collate_fn

    def __call__(self, samples: list) -> _Collated:
        good = [s for s in samples if not isinstance(s, SkippedSample)]
        errors = [s.error for s in samples if isinstance(s, SkippedSample)][:_KEEP_ERRORS]
        data = self.collate_fn(good) if good else None
        return _Collated(data, len(samples), len(samples) - len(good), errors)


class SlipstreamLoader:
    """Batches of a dataset for this rank, prefetched, timed and resumable.

    Arguments not listed below go to ``torch.utils.data.DataLoader``.

    * ``seed``, ``shuffle``, ``drop_last``, ``rank``, ``world_size``,
      ``window_shards``: the sampler (see ResumableSampler; rank/world size
      default to torch.distributed). For a ShardedDataset, ``shuffle=True``
      is the block shuffle ("shards"): shard order per epoch, samples mixed
      within windows of ``window_shards`` shards, each rank on its own shards;
      ``shuffle="global"`` is one permutation of all samples (small data).
    * ``prefetch_batches``: finished batches the background thread keeps
      ready (0: no thread, read on demand).
    * ``on_skip``: called with each skipped sample's error text when the
      dataset was opened with ``on_error="skip"``; batches then hold fewer samples.
    * ``fetch_ahead``: for a ShardedDataset read from a URL through a cache,
      threads that download the shards this rank will read, in order of first
      use, while training runs (0: off). With a cache limit and the "shards"
      order, the shards in use plus those fetched ahead stay within this
      rank's share of the cache (``max_bytes`` / ranks on the node); the fetcher
      moves on as windows are finished. In the "global" order every shard stays
      in use all epoch, so at most half the cache is fetched ahead, once.

    Example::

        loader = SlipstreamLoader(ShardedDataset("/data/tokens"), batch_size=8, seed=0, num_workers=2)
        for batch in loader:
            train_step(batch)
            recorder.add("data_wait_s", loader.last_wait_s)
        ckpt["data"] = loader.state_dict()
    """

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool | str = True,
        window_shards: int = DEFAULT_WINDOW_SHARDS,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        prefetch_batches: int = 2,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        pin_memory: bool = False,
        collate_fn: Callable[[list], Any] | None = None,
        multiprocessing_context: Any = None,
        timeout_s: float = 0,
        on_skip: Callable[[str], None] | None = None,
        fetch_ahead: int = 4,
    ):
        if fetch_ahead < 0:
            raise ConfigError(f"fetch_ahead must be >= 0, got {fetch_ahead}")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        if prefetch_batches < 0:
            raise ConfigError(f"prefetch_batches must be >= 0, got {prefetch_batches}")
        if num_workers < 0:
            raise ConfigError(f"num_workers must be >= 0, got {num_workers}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.prefetch_batches = int(prefetch_batches)
        shard_sizes = [info.num_samples for info in dataset.index.shards] if isinstance(dataset, ShardedDataset) else None
        self.sampler = ResumableSampler(
            len(dataset), seed=seed, shuffle=shuffle, drop_last=drop_last, rank=rank, world_size=world_size,
            shard_sizes=shard_sizes, window_shards=window_shards,
        )
        extra: dict[str, Any] = {}
        if num_workers > 0:
            extra["persistent_workers"] = True if persistent_workers is None else persistent_workers
            if prefetch_factor is not None:
                extra["prefetch_factor"] = prefetch_factor
            if multiprocessing_context is not None:
                extra["multiprocessing_context"] = multiprocessing_context
        self.dataloader = torch.utils.data.DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=self.sampler,
            num_workers=num_workers,
            collate_fn=_CountingCollate(collate_fn or default_collate),
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout_s,
            **extra,
        )
        self.on_skip = on_skip
        self.last_wait_s = 0.0
        self.wait_s_total = 0.0
        self.batches_total = 0
        self.samples_total = 0
        self.skipped_total = 0
        self.skipped_errors: list[str] = []
        # A weak reference: a cycle loader <-> iterator would leave the DataLoader's
        # workers to the cyclic GC, which can close their queues before telling
        # them to stop (10 s of join timeouts at exit).
        self._active: weakref.ref[_LoaderIter] | None = None
        self.fetch_ahead = int(fetch_ahead)
        self._fetcher: _FetchAhead | None = None

    # ------------------------------------------------------------- iteration
    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch``; a no-op when already in it (so resume keeps its position)."""
        self._stop_active()
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        """Batches left in the current epoch for this rank."""
        n = self.sampler.local_len()
        return n // self.batch_size if self.dataloader.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> "_LoaderIter":
        self._stop_active()
        if self.sampler.epoch_done:
            self.sampler.set_epoch(self.sampler.epoch + 1)
        self._start_fetcher()
        it = _LoaderIter(self)
        self._active = weakref.ref(it)
        return it

    def _start_fetcher(self) -> None:
        ds = self.dataset
        if self.fetch_ahead and isinstance(ds, ShardedDataset) and ds.cache is not None and not ds.source.is_local:
            self._fetcher = _FetchAhead(ds, self.sampler, self.fetch_ahead)

    def _stop_active(self) -> None:
        it = self._active() if self._active is not None else None
        if it is not None:
            it.close()
        self._active = None
        if self._fetcher is not None:
            self._fetcher.close()
            self._fetcher = None

    def close(self) -> None:
        """Stop the prefetch thread and the worker processes (they restart on the next iter)."""
        self._stop_active()
        if getattr(self.dataloader, "_iterator", None) is not None:
            self.dataloader._iterator = None  # torch shuts persistent workers down when it is freed

    # ------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """(epoch, global position) of what the training loop consumed, plus the seed and sizes."""
        return self.sampler.state_dict(roll_over=True)

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved (epoch, position); the world size may differ (see ResumableSampler).

        An iterator in use goes on from the loaded position (prefetched batches dropped): a run
        that healed in place (``slipstream run --heal``) went back to a snapshot while its
        ``for batch in loader`` loop was running, and that loop rewinds with it."""
        active = self._active() if self._active is not None else None
        self._stop_active()
        self.sampler.load_state_dict(state)
        if active is not None:
            self._start_fetcher()
            active.reopen()
            self._active = weakref.ref(active)

    def stats(self) -> dict[str, float]:
        """For the metrics recorder: data wait of the last step and in total, skips."""
        return {
            "data_wait_s": self.last_wait_s,
            "data_wait_s_total": self.wait_s_total,
            "data_batches_total": self.batches_total,
            "data_skipped_total": self.skipped_total,
        }

    # called by _LoaderIter in the training thread
    def _consumed(self, item: _Collated, wait_s: float) -> None:
        self.sampler.advance(item.n)
        self.last_wait_s = wait_s
        self.wait_s_total += wait_s
        self.samples_total += item.n - item.skipped
        if item.skipped:
            self.skipped_total += item.skipped
            for e in item.errors:
                if len(self.skipped_errors) < 100:
                    self.skipped_errors.append(e)
                if self.on_skip is not None:
                    self.on_skip(e)


class _FetchAhead:
    """Downloads the shards this rank reads next into the node cache, in order of first use.

    A planner thread walks the sampler's ``shard_schedule()`` (lazy: one
    window at a time) and hands downloads to ``workers`` threads. It holds a
    shard from when it is planned until the training loop has consumed past
    its last use; it plans the next shard only while the shards it holds fit in
    the budget: this rank's share of the cache (``max_bytes`` over the ranks
    on this node, from the launch environment; 1 without one), or half of it
    in the "global" order, where nothing is released before the epoch ends.
    Shards already cached count but are not downloaded. One shard is always
    allowed, so a shard larger than the budget does not stall the plan.

    Runs in the training process; data-loader workers that need a shard being
    fetched wait on its file lock and then find it cached. Failures are only
    counted here: the reader's own fetch raises (or skips) with the full story.
    """

    def __init__(self, ds: ShardedDataset, sampler: ResumableSampler, workers: int):
        self.planned = 0
        self.failed = 0
        self.futures: list = []
        self.held_bytes_max = 0
        budget = None
        if ds.cache.max_bytes:
            budget = ds.cache.max_bytes // max(1, detect_launch_env().local_world_size)
            if not sampler.blocked:
                budget //= 2
        self.budget_bytes = budget
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slipstream-fetch-ahead")
        base, world = sampler.start, sampler.world_size
        schedule = sampler.shard_schedule()
        self._thread = threading.Thread(
            target=self._plan, args=(ds, sampler, schedule, base, world), name="slipstream-fetch-plan", daemon=True
        )
        self._thread.start()

    def _plan(self, ds: ShardedDataset, sampler: ResumableSampler, schedule, base: int, world: int) -> None:
        cache, index = ds.cache, ds.index
        held: dict[int, int] = {}  # shard -> local offset of its last use
        try:
            for shard, _first, last in schedule:
                if self._stop.is_set():
                    return
                if shard in held:
                    held[shard] = max(held[shard], last)
                    continue
                info = index.shards[shard]
                while self.budget_bytes is not None:
                    consumed = (sampler.start - base) // world  # this rank's samples the loop has taken
                    for s in [s for s, end in held.items() if end < consumed]:
                        del held[s]
                    used = sum(index.shards[s].size_bytes for s in held)
                    if not held or used + info.size_bytes <= self.budget_bytes:
                        break
                    if self._stop.wait(0.02):
                        return
                held[shard] = last
                self.held_bytes_max = max(self.held_bytes_max, sum(index.shards[s].size_bytes for s in held))
                self.planned += 1
                if not cache.contains(info):
                    if self._stop.is_set():
                        return
                    self.futures.append(self._pool.submit(self._fetch, cache, ds.source, info))
        except RuntimeError:  # the pool was shut down by close() between the check and the submit
            return
        except Exception:  # noqa: BLE001 - the reader meets the same problem and reports it
            self.failed += 1

    def _fetch(self, cache, source, info) -> None:
        if self._stop.is_set():
            return
        try:
            cache.fetch(source, info)
        except Exception:  # noqa: BLE001 - reported by the reader that needs the shard
            self.failed += 1

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


_BATCH, _END, _ERROR = 0, 1, 2


class _LoaderIter:
    def __init__(self, loader: SlipstreamLoader):
        self.loader = loader
        self.reopen()

    def reopen(self) -> None:
        """(Re)start from the sampler's position: at creation, and after a load_state_dict while in use."""
        loader = self.loader
        self._done = False
        self._thread: threading.Thread | None = None
        self._it = iter(loader.dataloader)
        if loader.prefetch_batches > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=loader.prefetch_batches)
            self._stop = threading.Event()
            # The thread gets no reference to this object, so a loop that breaks
            # early frees the iterator, whose __del__ stops the thread.
            self._thread = threading.Thread(
                target=_produce, args=(self._it, self._queue, self._stop), name="slipstream-prefetch", daemon=True
            )
            self._thread.start()

    def _get(self) -> tuple:
        if self._thread is None:
            try:
                return (_BATCH, next(self._it))
            except StopIteration:
                return (_END, None)
        return self._queue.get()

    def __iter__(self) -> "_LoaderIter":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        wait = 0.0
        while True:
            t0 = time.perf_counter()
            kind, item = self._get()
            wait += time.perf_counter() - t0
            if kind == _ERROR:
                self.close()
                raise item
            if kind == _END:
                sampler = self.loader.sampler
                sampler.start = sampler.end_position()  # also past a dropped partial batch
                self.loader.last_wait_s = wait
                self.loader.wait_s_total += wait
                self.close()
                raise StopIteration
            self.loader._consumed(item, wait)
            if item.data is None:  # every sample of the batch was skipped
                wait = 0.0
                continue
            self.loader.batches_total += 1
            return item.data

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._it = None

    def __del__(self) -> None:
        if self._thread is not None:
            self._stop.set()


def _produce(it, q: queue.Queue, stop: threading.Event) -> None:
    def put(msg: tuple) -> bool:
        while not stop.is_set():
            try:
                q.put(msg, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    try:
        for item in it:
            if stop.is_set() or not put((_BATCH, item)):
                return
        put((_END, None))
    except BaseException as exc:  # handed to the training thread
        put((_ERROR, exc))
