"""Data pipeline: sharded memory-mapped datasets, a node cache for object stores, resumable loading.

Example::

    from slipstream.data import ShardCache, ShardedDataset, SlipstreamLoader, pack_text, prewarm

    pack_text("corpus/", "s3://bucket/tokens", tokens_per_sample=1025)      # once
    cache = ShardCache("/nvme/cache", max_bytes=100 << 30)
    prewarm("s3://bucket/tokens", cache, workers=16)                       # optional, ahead of time
    ds = ShardedDataset("s3://bucket/tokens", cache=cache)
    loader = SlipstreamLoader(ds, batch_size=8, seed=0, num_workers=2)     # rank/world from torch.distributed
    for batch in loader:
        ...                                   # loader.last_wait_s: data wait of this step
    state = loader.state_dict()               # (epoch, position): save with the checkpoint

See docs/data.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Eager, and torch-free (numpy only): the function `pack` shares its name with its module,
# so importing slipstream.data.pack anywhere would otherwise bind the *module* to
# `slipstream.data.pack` and PEP 562's __getattr__ would never run for it.
from .pack import pack, pack_arrays, pack_files, pack_text

# public name -> the module that defines it. Imported on first use (PEP 562): the
# dataset and loader need torch, and `slipstream data --help` (or `slipstream --help`,
# which lists it) should not pay for that.
_LAZY = {
    "CacheStats": ".cache", "PrewarmReport": ".cache", "ShardCache": ".cache", "load_index": ".cache",
    "prewarm": ".cache",
    "ShardedDataset": ".dataset", "SkippedSample": ".dataset", "verify_dataset": ".dataset",
    "DataIntegrityError": ".format", "Field": ".format", "Index": ".format", "ShardInfo": ".format",
    "ShardReader": ".format", "ShardWriter": ".format",
    "SlipstreamLoader": ".loader",
    "ResumableSampler": ".sampler",
    "Source": ".source", "SourceUnavailable": ".source",
}

if TYPE_CHECKING:
    from .cache import CacheStats, PrewarmReport, ShardCache, load_index, prewarm
    from .dataset import ShardedDataset, SkippedSample, verify_dataset
    from .format import DataIntegrityError, Field, Index, ShardInfo, ShardReader, ShardWriter
    from .loader import SlipstreamLoader
    from .sampler import ResumableSampler
    from .source import Source, SourceUnavailable


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CacheStats",
    "DataIntegrityError",
    "Field",
    "Index",
    "PrewarmReport",
    "ResumableSampler",
    "ShardCache",
    "ShardInfo",
    "ShardReader",
    "ShardWriter",
    "ShardedDataset",
    "SkippedSample",
    "SlipstreamLoader",
    "Source",
    "SourceUnavailable",
    "load_index",
    "pack",
    "pack_arrays",
    "pack_files",
    "pack_text",
    "prewarm",
    "verify_dataset",
]
