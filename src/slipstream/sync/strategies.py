"""What the rest of the code needs to know about a sync strategy: one frozen description each.

Code outside :mod:`slipstream.sync` asks :func:`describe` a question (does this strategy need
the bucket-order fix? does it run on sharded replicas? can the run heal in place?) instead of
comparing the strategy's name with a string, so a new strategy is added here and in
``sync/__init__.py`` and nowhere else. ``hierarchical+X`` is parsed here, once.

Pure: no torch, no process group (``slipstream validate`` and the configuration checks read it).

Example::

    from slipstream import sync
    info = sync.describe("hierarchical+bf16")
    info.kind, info.levels, info.codec          # (SyncKind.HOOK, 2, 'bf16')
    sync.describe("diloco").fixes_bucket_order  # False
    sync.describe("dilcoo")                     # UnknownStrategy: ... (did you mean 'diloco'?)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..errors import ConfigError, did_you_mean
from .compress import CODECS

TWO_LEVELS_PREFIX = "hierarchical+"
"""``hierarchical+X``: two-level reduction with codec X (or ``auto``) on the inter-node step."""


class SyncKind(str, Enum):
    """How a strategy reaches the gradients."""

    REDUCER = "reducer"
    """DDP's built-in C++ reducer, untouched: no comm hook is installed."""
    HOOK = "hook"
    """A DDP comm hook: every bucket goes through the hook engine (:mod:`.hooks`)."""
    OUTER_LOOP = "outer_loop"
    """Nothing is summed in backward; an outer step after the optimizer's (``diloco``)."""


class OptionSet(str, Enum):
    """Which options a strategy takes (:meth:`.options.SyncOptions.parse` checks them)."""

    NONE = "none"
    """No option at all."""
    CODEC = "codec"
    """The guard's, ``warmup_steps``, and the options of its codec."""
    AUTO = "auto"
    """The guard's, ``auto``'s, and the options of every candidate codec."""
    DILOCO = "diloco"
    """The outer loop's (``inner_steps``, ``outer_lr``, ...)."""
    OWN = "own"
    """A strategy registered by a user: it checks its own options."""


@dataclass(frozen=True)
class StrategyInfo:
    """One strategy, as the configuration checks, the layouts and the adopter need to know it."""

    name: str
    kind: SyncKind
    codec: str | None = None
    """The codec of every bucket (with two levels: of the inter-node step); ``allreduce``: none.
    None where it is chosen per bucket (``auto``) or nothing is sent per step (``diloco``)."""
    levels: int = 1
    """1: one flat reduction; 2: intra-node reduce-scatter, inter-node step, intra-node all-gather."""
    auto: bool = False
    """The codec of each bucket is chosen at run time from the probed link (``auto``)."""
    options: OptionSet = OptionSet.OWN
    fixes_bucket_order: bool = True
    """Whether the bucket layout is fixed before the strategy is installed, so a resumed run sums
    gradients in the order the run did. ``diloco`` sums no gradient: the fix would only send
    the model's size over a link chosen for being slow."""
    on_sharded_replicas: bool = False
    """Whether it can join replicas that FSDP2 shards inside (``dp_shard``) over ``dp_replicate``
    (:func:`slipstream.sync.apply_to_replicas`); every other strategy needs DDP."""
    heals_in_place: bool = False
    """Whether a run with it can heal in place: its handle forms its groups again after a lost rank
    (:meth:`slipstream.sync.SyncHandle.leave` / ``rejoined``) and its checkpoint state is all that
    changes results (a snapshot restores it). Every built-in strategy does; one registered
    outside slipstream does not, unless its description says so."""

    def __post_init__(self) -> None:
        if self.levels not in (1, 2):
            raise ValueError(f"strategy {self.name!r}: levels must be 1 or 2, got {self.levels}")
        if self.on_sharded_replicas and self.kind is not SyncKind.OUTER_LOOP:
            raise ValueError(f"strategy {self.name!r}: only an outer loop runs on sharded replicas "
                             "(a DDP hook needs DDP's buckets)")

    @property
    def installs_comm_hook(self) -> bool:
        """Whether :func:`slipstream.sync.apply` registers a DDP comm hook (a script's own would clash)."""
        return self.kind is not SyncKind.REDUCER


class UnknownStrategy(ConfigError, KeyError):
    """A name no strategy is registered under: a :class:`~slipstream.errors.ConfigError` (one
    line, exit 2) and, as before, a ``KeyError``."""

    def __str__(self) -> str:  # KeyError's would quote the whole message
        return str(self.args[0]) if self.args else ""


def two_level(info: StrategyInfo, codec: str) -> StrategyInfo:
    """``hierarchical+codec``: the two-level form of a codec strategy ``info``."""
    return StrategyInfo(f"{TWO_LEVELS_PREFIX}{codec}", SyncKind.HOOK, codec=codec, levels=2,
                        options=info.options, heals_in_place=info.heals_in_place)


def split_two_level(name: str) -> str | None:
    """X of ``hierarchical+X`` where X is a codec that compresses; None for any other name."""
    if name.startswith(TWO_LEVELS_PREFIX):
        codec = name[len(TWO_LEVELS_PREFIX):]
        if codec in CODECS and codec != "allreduce":
            return codec
    return None


def lookup(name: str, registered: dict[str, StrategyInfo]) -> StrategyInfo | None:
    """The description of ``name`` among ``registered`` and their two-level forms; None if none."""
    if name in registered:
        return registered[name]
    codec = split_two_level(name)
    if codec is None:
        return None
    return two_level(registered.get(codec) or StrategyInfo(codec, SyncKind.HOOK, options=OptionSet.CODEC), codec)


def unknown(name: str, known: tuple[str, ...]) -> UnknownStrategy:
    """The error for a name no strategy is registered under, with the closest known one."""
    return UnknownStrategy(f"unknown sync strategy {name!r}" + did_you_mean(str(name), known, quote=True)
                           + f"; known: {', '.join(known)}")


__all__ = ["OptionSet", "StrategyInfo", "SyncKind", "TWO_LEVELS_PREFIX", "UnknownStrategy", "lookup",
           "split_two_level", "two_level", "unknown"]
