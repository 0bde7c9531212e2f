"""Gradient synchronisation strategies, selected by name.

A strategy is applied to a DistributedDataParallel model once, after wrapping:
``state = apply(name, ddp_model)``. Names:

=====================  ==================================================================
``allreduce``          DDP's own C++ reducer (fused buckets overlapping backward), untouched
``bf16`` / ``fp16``    16-bit cast, one all-reduce per bucket
``powersgd``           rank-r PowerSGD, error feedback, warm start (options: rank, min_compression)
``topk``               top-k sparsification + error feedback (option: density)
``sign``               scaled 1-bit sign + error feedback (option: chunk_numel)
``hierarchical``       intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather
``hierarchical+X``     the same with codec X on the inter-node step only (X: any codec above)
``auto``               probes the link, observes backward, picks per bucket from an alpha-beta model
                       (and, on several nodes of several ranks, flat or two-level reduction)
``hierarchical+auto``  two levels, always; probes both links, and picks per bucket the codec of the inter-node step
``diloco``             no per-step sync: local steps, then every H steps an outer step on the averaged
                       parameter change (options: inner_steps, outer_lr, outer_momentum, fragments, ...)
=====================  ==================================================================

``diloco`` also runs on replicas that FSDP2 shards inside (``dp_shard``):
:func:`apply_to_replicas` installs it on the sharded module with the replicas' group.

Every strategy but ``allreduce`` and ``diloco`` runs through :mod:`.hooks`, which keeps one
global collective order (see there); ``diloco`` (:mod:`.diloco`) sends nothing in backward
and all-reduces from :meth:`SyncHandle.after_optimizer_step`, on the training loop's thread. The returned state is a
:class:`SyncHandle`: ``stats()``, ``state_dict()``/``load_state_dict()``,
``observe_loss()``, ``request_probe()``, ``decision_summary()``, ``close()``.
Options and their defaults: :class:`~.options.SyncOptions`. What the rest of the code needs to
know about a strategy (DDP's reducer, a comm hook or an outer loop; its codec and levels; whether
it needs the bucket-order fix, runs on sharded replicas, heals in place) is its
:class:`~.strategies.StrategyInfo`, given to :func:`register` and read with :func:`describe`:
code outside this package asks it and never compares a strategy's name.

A strategy of your own: :func:`register` a function ``fn(ddp_model, **options) -> SyncHandle``,
or :func:`register_codec` a codec (:class:`~.compress.base.Codec`) for the hook engine to run.
For ``slipstream run --sync NAME`` and job specs every process must know it: declare it as an
entry point of group ``slipstream.sync_strategies`` of an installed package (:mod:`.discovery`),
loaded lazily, once, by :func:`available` and :func:`describe`.

Example::

    from slipstream import sync
    sync.is_valid("hierarchical+powersgd")     # True
    sync.describe("diloco").fixes_bucket_order  # False
    state = sync.apply("powersgd", ddp_model, rank=8)
    state.stats()["sync_compression_ratio"]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..network.link import allreduce_bytes
from .compress import CODECS, make_codec
from .strategies import (
    TWO_LEVELS_PREFIX,
    OptionSet,
    StrategyInfo,
    SyncKind,
    UnknownStrategy,
    lookup,
    split_two_level,
    unknown,
)

if TYPE_CHECKING:
    # torch is imported where a strategy is applied, not here: the names above
    # (available, is_valid) are read by config checks and `slipstream validate`,
    # which should not pay for importing torch.
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from .compress.base import Codec
    from .options import SyncOptions

_Strategy = Callable[..., "SyncHandle"]  # fn(ddp_model, **options) -> state
_REGISTRY: dict[str, _Strategy] = {}
_INFO: dict[str, StrategyInfo] = {}
# Installed packages' strategies (entry points, .discovery): loaded on the first question the
# built-ins cannot answer, once; the ones that failed, by name, with the line saying why.
_DISCOVERED = False
_BROKEN: dict[str, str] = {}


def register(name: str, info: StrategyInfo | None = None) -> Callable[[_Strategy], _Strategy]:
    """Register ``fn(ddp_model, **options) -> state`` under ``name``, described by ``info``
    (default: a DDP comm hook that checks its own options, fixes the bucket order, needs DDP
    and does not heal in place: slipstream cannot know what it keeps outside its state_dict)."""
    if info is not None and info.name != name:
        raise ValueError(f"strategy {name!r} registered with the description of {info.name!r}")

    def deco(fn: _Strategy) -> _Strategy:
        _REGISTRY[name] = fn
        _INFO[name] = info or StrategyInfo(name, SyncKind.HOOK)
        return fn

    return deco


def register_codec(name: str, make: Callable[..., Codec], info: StrategyInfo | None = None) -> _Strategy:
    """Register strategy ``name``: the hook engine (one global collective order, warm-up, the
    convergence guard where the codec has error feedback, its state in checkpoints) running every
    bucket through the codec ``make(**options)`` builds, one per run. The options the engine
    takes (``warmup_steps`` and the guard's, :class:`~.options.SyncOptions`) go to the engine,
    the others to ``make``. ``info``: as for :func:`register` (default: a comm hook that checks
    its own options and does not heal in place). Returns the strategy function.

    Example::

        class Half(Codec):   # the contract: sync/compress/base.py
            def reduce(self, flat, wire, key, layout=None):
                payload = flat.to(torch.bfloat16); wire.allreduce(payload)
                return flat.copy_(payload).div_(wire.size)

        sync.register_codec("half", Half)
        slipstream.accelerate(model, opt, sync="half", sync_options={"warmup_steps": 2})
    """
    def strategy(ddp_model: DistributedDataParallel, **options: Any) -> SyncHandle:
        from .options import CODEC_STRATEGY_OPTION_NAMES, GUARD_OPTION_NAMES, SyncOptions

        engine = set(GUARD_OPTION_NAMES) | set(CODEC_STRATEGY_OPTION_NAMES)
        opts = SyncOptions(**{k: v for k, v in options.items() if k in engine})
        # Built before the one-rank check, so a wrong option fails on one rank as on many.
        codec = make(**{k: v for k, v in options.items() if k not in engine})
        return _hook_engine(name, ddp_model, name, lambda: codec, opts)

    strategy.__name__ = f"_{name}"
    return register(name, info or StrategyInfo(name, SyncKind.HOOK))(strategy)


def _discover() -> None:
    """Load the installed packages' strategies (:mod:`.discovery`), the first time only."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True  # first: a package's function that asks the registry does not load them again
    from .discovery import load_strategies

    _BROKEN.update(load_strategies(lambda name: name in _REGISTRY))


def available() -> tuple[str, ...]:
    """Every valid strategy name, combinations (``hierarchical+powersgd``) included, and the
    installed packages' (loaded on the first call)."""
    _discover()
    combos = tuple(f"{TWO_LEVELS_PREFIX}{c}" for c in CODECS if c != "allreduce")
    return tuple(_REGISTRY) + combos


def is_valid(name: str) -> bool:
    """Whether ``name`` is a strategy :func:`apply` accepts."""
    return name in available()


def describe(name: str) -> StrategyInfo:
    """What the rest of the code needs to know about strategy ``name`` (:class:`StrategyInfo`);
    :class:`UnknownStrategy` (a ConfigError and a KeyError) naming the closest known name.

    Example::

        sync.describe("diloco").on_sharded_replicas     # True
        sync.describe("allreduce").heals_in_place       # True
    """
    info = lookup(name, _INFO) if isinstance(name, str) else None
    if info is None and isinstance(name, str) and not _DISCOVERED:
        _discover()  # not built in: perhaps an installed package's
        info = lookup(name, _INFO)
    if info is None:
        if name in _BROKEN:
            raise UnknownStrategy(_BROKEN[name])
        raise unknown(str(name), available())
    return info


def matching(question: Callable[[StrategyInfo], bool]) -> tuple[str, ...]:
    """The registered strategies whose description answers ``question`` with yes (in registration order).

    Example::

        sync.matching(lambda info: info.auto)     # ('auto', 'hierarchical+auto')
    """
    _discover()
    return tuple(n for n, info in _INFO.items() if question(info))


def strategies_help() -> str:
    """The strategies for a one-line help text: ``allreduce, bf16, ..., hierarchical[+X], auto, diloco``
    (each two-level form is written once, after the plain two-level strategy)."""
    plain = [n for n in _REGISTRY if not n.startswith(TWO_LEVELS_PREFIX)]
    return ", ".join(f"{n}[+X]" if _INFO[n].levels == 2 else n for n in plain)


class SyncHandle(Protocol):
    """What :func:`apply` returns: the installed strategy's state, as the training loop uses it.

    :class:`AllreduceState` (DDP's reducer, untouched) and
    :class:`~slipstream.sync.hooks.HookSync` (every hook strategy) implement all of it,
    so callers need no ``hasattr``: a method that means nothing for a strategy is a
    documented no-op there.

    Example::

        handle: SyncHandle = sync.apply("auto", ddp_model)
        loss.backward(); handle.observe_loss(loss.detach())
        handle.stats()["sync_decision"]      # 'allreduce (observing)', later 'allreduce:3,powersgd:2'
    """

    name: str
    steps_between_syncs: int
    """Optimizer steps from one point where every rank synchronizes to the next: 1 for a strategy
    that reduces every step, DiLoCo's H (``inner_steps``). In-memory snapshots, which a heal goes
    back to, are taken at those points only, so every rank holds the same one."""

    def stats(self) -> dict[str, Any]:
        """Figures merged into every metrics record (``sync_bytes_sent``, ...)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Per-rank checkpoint state (error-feedback buffers, low-rank factors, counters)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def observe_loss(self, loss: float | torch.Tensor) -> None:
        """The loss of each synchronising micro-step, for the convergence guard
        (a device tensor; read only at the guard's checks). A no-op without a guard."""
        ...

    def request_probe(self) -> None:
        """Re-measure the link at the next synchronising step (``auto``: observe and decide again).
        Every rank calls it at the same step. A no-op where nothing depends on the link."""
        ...

    def decision_summary(self) -> str:
        """The codecs in use, counted over buckets (``"allreduce:3,powersgd:2"``)."""
        ...

    def use_loss_scale(self, scale: Callable[[], torch.Tensor | None] | None) -> None:
        """Gradients arrive multiplied by this loss scale (a 0-dim device tensor; fp16's
        GradScaler): error feedback is kept in true-gradient units. A no-op where no codec
        carries state between steps."""
        ...

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer that steps the model (before any checkpoint is restored). ``diloco``
        keeps its per-rank state in :meth:`state_dict`; a no-op elsewhere."""
        ...

    def after_optimizer_step(self) -> None:
        """Called by the training loop after every optimizer step, on every rank (``diloco``:
        the outer step when due, a collective then); a no-op elsewhere."""
        ...

    def close(self) -> None:
        """Stop background work (the hook engine's ordering thread); idempotent."""
        ...

    def leave(self) -> None:
        """Healing in place (:mod:`slipstream.resilience.heal`), after the default group failed and was
        destroyed: stop what runs on the strategy's groups and let go of every one of them, so
        their sockets close and no peer waits on them. No collective."""
        ...

    def rejoined(self, group: Any = None) -> None:
        """Healing in place, once the default group was formed again (a replacement: its first
        real one): form the strategy's groups again, in the same order on every rank (a
        collective), and drop what lived only inside the failed step. The state itself then comes
        back from the snapshot (:meth:`load_state_dict`). ``group``: the group that joins the
        replicas where it is not the default one (``diloco`` on sharded replicas: the mesh's
        new ``dp_replicate`` group); None: the default group."""
        ...


def apply(name: str, ddp_model: DistributedDataParallel, **options: Any) -> SyncHandle:
    """Install strategy ``name`` on ``ddp_model``; returns its state (a :class:`SyncHandle`).

    Collective: every rank calls it, right after wrapping the model in DDP and
    before the first forward.

    Example::

        handle = sync.apply("bf16", ddp_model)
        handle.stats()["sync_compression_ratio"]   # 2.0
    """
    info = describe(name)  # UnknownStrategy (a KeyError) for a name nothing is registered under
    if name in _REGISTRY:
        return _REGISTRY[name](ddp_model, **options)
    assert info.codec is not None  # a two-level form of a codec (strategies.lookup)
    return _hook_strategy(name, ddp_model, info.codec, hierarchical=info.levels == 2, **options)


class AllreduceState:
    """Accounting for DDP's built-in reducer (no hook: nothing is added to its hot path).

    Bytes per step are the ring all-reduce payload of all gradients, 2(n-1)/n * S,
    counted once per synchronising backward.
    """

    steps_between_syncs = 1  # every optimizer step reduces on every rank

    def __init__(self, ddp_model: DistributedDataParallel, name: str = "allreduce"):
        import torch.distributed as dist

        self.name = name
        n = dist.get_world_size(ddp_model.process_group) if ddp_model.process_group is not None else 1
        params = [p for p in ddp_model.module.parameters() if p.requires_grad]
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        self.bytes_per_step = allreduce_bytes(grad_bytes, n)
        self.steps = 0
        self._ddp = ddp_model
        if params:
            # Fires once per backward; counts only backwards that synchronise.
            params[0].register_post_accumulate_grad_hook(self._count)

    def _count(self, _param: torch.Tensor) -> None:
        if self._ddp.require_backward_grad_sync:
            self.steps += 1

    def stats(self) -> dict[str, Any]:
        return {
            "sync_strategy": self.name,
            "sync_mode": "run",
            "sync_steps": self.steps,
            "sync_bytes_sent": self.bytes_per_step,
            "sync_uncompressed_bytes": self.bytes_per_step,
            "sync_compression_ratio": 1.0,
            "sync_bytes_sent_total": self.bytes_per_step * self.steps,
            "sync_decision": self.decision_summary(),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))

    def observe_loss(self, loss: float | torch.Tensor) -> None:
        """No convergence guard here (nothing is compressed): nothing to observe."""

    def request_probe(self) -> None:
        """Nothing here depends on the link: nothing to measure."""

    def decision_summary(self) -> str:
        return "allreduce (DDP reducer)"

    def use_loss_scale(self, scale: Callable[[], torch.Tensor | None] | None) -> None:
        """DDP's reducer carries nothing between steps: the scale does not matter."""

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state is the same on every rank: the shared checkpoint holds it."""

    def after_optimizer_step(self) -> None:
        """Every step already synchronised in backward: nothing to do."""

    def close(self) -> None:
        """Nothing runs in the background."""

    def leave(self) -> None:
        """No group of its own: DDP's reducer holds the default one (the layout moves it)."""

    def rejoined(self, group: Any = None) -> None:
        """No group of its own to form again; the step counter comes back with the snapshot."""


def _single_rank(ddp_model: DistributedDataParallel) -> bool:
    """One rank: nothing to synchronise, so nothing to compress (a codec would only lose
    accuracy); DDP's reducer is left as it is."""
    import logging

    import torch.distributed as dist

    if dist.get_world_size() > 1:
        return False
    logging.getLogger("slipstream.sync").info("sync: one rank, nothing to synchronise: DDP's reducer left as is")
    return True


def _heal_pending() -> bool:
    """Whether this process replaces a dead rank and has not joined the survivors yet (its default
    group is a fake one: :mod:`slipstream.resilience.heal`)."""
    from ..resilience import heal

    return heal.on_fake_group()


def _model_device(ddp_model: DistributedDataParallel) -> torch.device:
    """Where the model's gradients live: the device of every data collective."""
    import torch

    for p in ddp_model.module.parameters():
        return p.device
    return torch.device("cpu")


def _hook_strategy(name: str, ddp_model: DistributedDataParallel, codec: str, hierarchical: bool = False,
                   **options: Any) -> SyncHandle:
    from .options import SyncOptions

    opts = SyncOptions.parse(name, options)
    return _hook_engine(name, ddp_model, codec, lambda: make_codec(codec, **opts.codec_kwargs(codec)), opts,
                        hierarchical)


def _hook_engine(name: str, ddp_model: DistributedDataParallel, codec: str, make: Callable[[], Codec],
                 opts: SyncOptions, hierarchical: bool = False) -> SyncHandle:
    """The hook engine with one codec (``make()``, named ``codec``) for every bucket."""
    from .control import ControlWire
    from .guard import ConvergenceGuard
    from .hierarchical import FlatReducer, Hierarchical
    from .hooks import HookSync
    from .probe import probe_levels, probe_link
    from .topology import groups

    if _single_rank(ddp_model):
        return AllreduceState(ddp_model, name)
    g = groups()
    reducer = Hierarchical(g) if hierarchical else FlatReducer(g.flat)
    c = make()
    guard = ConvergenceGuard(**opts.guard_kwargs()) if opts.guard and c.error_feedback else None
    device = _model_device(ddp_model)
    # The groups are looked up when a probe runs: after healing in place they are new ones.
    prober = (lambda: probe_levels(groups(), device)) if hierarchical else (
        lambda: probe_link(groups().flat, device=device, control=ControlWire(groups().control)))
    return HookSync(name, reducer, {codec: c}, codec, control_group=g.control, guard=guard,
                    options=opts, prober=prober).install(ddp_model)


@register("allreduce", StrategyInfo("allreduce", SyncKind.REDUCER, codec="allreduce", options=OptionSet.NONE,
                                   heals_in_place=True))
def _allreduce(ddp_model: DistributedDataParallel, **options: Any) -> AllreduceState:
    if options:
        raise TypeError(f"sync strategy 'allreduce' takes no options, got {', '.join(sorted(options))}")
    return AllreduceState(ddp_model)


def _codec_strategy(codec: str) -> _Strategy:
    def strategy(ddp_model: DistributedDataParallel, **options: Any) -> SyncHandle:
        return _hook_strategy(codec, ddp_model, codec, **options)

    strategy.__name__ = f"_{codec}"
    return strategy


for _c in ("bf16", "fp16", "powersgd", "topk", "sign"):
    register(_c, StrategyInfo(_c, SyncKind.HOOK, codec=_c, options=OptionSet.CODEC,
                              heals_in_place=True))(_codec_strategy(_c))


@register("hierarchical", StrategyInfo("hierarchical", SyncKind.HOOK, codec="allreduce", levels=2,
                                      options=OptionSet.CODEC, heals_in_place=True))
def _hierarchical(ddp_model: DistributedDataParallel, **options: Any) -> SyncHandle:
    return _hook_strategy("hierarchical", ddp_model, "allreduce", hierarchical=True, **options)


@register("auto", StrategyInfo("auto", SyncKind.HOOK, auto=True, options=OptionSet.AUTO, heals_in_place=True))
def _auto(ddp_model: DistributedDataParallel, hierarchical: bool = False, **options: Any) -> SyncHandle:
    """Probe the link now; observe ``observe_steps`` uncompressed steps; decide per bucket.

    Options and their defaults: :class:`~.options.SyncOptions` (``candidates``,
    ``observe_steps``, ``hidden_tolerance``, ``verify_steps``, the guard's, and the
    candidates' codec options). ``hierarchical=True`` (the ``hierarchical+auto``
    strategy): two-level reduction, both levels probed, and the per-bucket choice is
    the codec of the inter-node step. Plain ``auto`` on a topology with both levels
    (several nodes of several ranks) probes the flat group and both levels, decides
    for each, and takes the level predicted faster (:mod:`.levels`;
    ``stats()["sync_level"]``). After a plan that compresses or changes the level,
    ``verify_steps`` steps under it are timed and compared with the uncompressed
    flat steps observed before; not faster -> back to flat all-reduce (logged, and
    in ``stats()["sync_verification"]``).
    """
    import logging

    import torch.distributed as dist

    from .auto import flat_prober, probe_sizes
    from .control import ControlWire
    from .guard import ConvergenceGuard
    from .hierarchical import FlatReducer, Hierarchical
    from .hooks import HookSync
    from .levels import FLAT, HIERARCHICAL, has_two_levels
    from .options import SyncOptions
    from .probe import probe_both, probe_levels
    from .topology import groups

    name = "hierarchical+auto" if hierarchical else "auto"
    opts = SyncOptions.parse("auto", options)
    if _single_rank(ddp_model):
        return AllreduceState(ddp_model, name)
    g = groups()
    device = _model_device(ddp_model)
    levels = None
    # Every probe scaled to the model: its gradient, at most the full 4 MiB (auto.probe_sizes),
    # on each level as on the flat group.
    gradient_bytes = sum(p.numel() * p.element_size() for p in ddp_model.parameters() if p.requires_grad)
    sizes = probe_sizes(gradient_bytes)
    # The groups are looked up when a probe runs: after healing in place they are new ones.
    if hierarchical:
        reducer, prober = Hierarchical(g), (lambda: probe_levels(groups(), device, sizes))
    elif has_two_levels(g.topology):
        # Both levels exist: build both reducers and probe both; the decision takes the
        # level predicted faster (flat until then: the observed steps run flat).
        reducer = FlatReducer(g.flat)
        levels = {FLAT: reducer, HIERARCHICAL: Hierarchical(g)}
        prober = lambda: probe_both(groups(), device, sizes)  # noqa: E731
    else:
        reducer = FlatReducer(g.flat)
        prober = lambda: flat_prober(groups().flat, ControlWire(groups().control), device, gradient_bytes)()  # noqa: E731
    # A replacement healing in place runs on a fake group until it joins: nothing to measure
    # there. Its link comes with its predecessor's state (the snapshot every rank goes back to).
    link = None if _heal_pending() else prober()
    codecs = {c: make_codec(c, **opts.codec_kwargs(c)) for c in opts.auto_candidates}
    guard = ConvergenceGuard(**opts.guard_kwargs()) if opts.guard else None
    state = HookSync(name, reducer, codecs, "allreduce", control_group=g.control, guard=guard,
                     options=opts, auto=True, link=link, prober=prober, levels=levels)
    if dist.get_rank() == 0 and link is not None:
        logging.getLogger("slipstream.sync").info("sync %s: probed link: %s", name, link.summary())
    return state.install(ddp_model)


@register("diloco", StrategyInfo("diloco", SyncKind.OUTER_LOOP, options=OptionSet.DILOCO, fixes_bucket_order=False,
                                on_sharded_replicas=True, heals_in_place=True))
def _diloco(ddp_model: DistributedDataParallel, **options: Any) -> SyncHandle:
    """Local steps, and every ``inner_steps`` an outer step (:mod:`.diloco`)."""
    from .diloco import on_ddp
    from .options import SyncOptions

    opts = SyncOptions.parse("diloco", options)
    if _single_rank(ddp_model):
        return AllreduceState(ddp_model, "diloco")
    return on_ddp(ddp_model, opts)


def apply_to_replicas(name: str, module: torch.nn.Module, replica_group: Any, **options: Any) -> SyncHandle:
    """Install ``name`` on a model whose gradients something else reduces inside each replica
    (FSDP2 over the ``dp_shard`` ranks), with ``replica_group`` joining each rank to the ranks
    that hold the same shard in the other replicas (the mesh's ``dp_replicate`` group).
    Only ``diloco`` synchronises whole replicas this way (:func:`.diloco.on_sharded_replicas`);
    any other name raises ConfigError. Collective over ``replica_group``.

    Example::

        handle = sync.apply_to_replicas("diloco", fsdp_module, mesh.get_group("dp_replicate"), inner_steps=20)
    """
    from ..errors import ConfigError

    install = _ON_REPLICAS.get(name) if describe(name).on_sharded_replicas else None
    if install is None:
        able = " or ".join(repr(n) for n in matching(lambda info: info.on_sharded_replicas))
        raise ConfigError(f"sync {name!r} is a DDP gradient hook; only {able} synchronises sharded replicas")
    return install(module, replica_group, **options)


def _diloco_on_replicas(module: torch.nn.Module, replica_group: Any, **options: Any) -> SyncHandle:
    from .diloco import on_sharded_replicas
    from .options import SyncOptions

    return on_sharded_replicas(module, replica_group, SyncOptions.parse("diloco", options))


# The strategies that join sharded replicas (describe(name).on_sharded_replicas), by name:
# fn(module, replica_group, **options) -> state.
_ON_REPLICAS: dict[str, Callable[..., SyncHandle]] = {"diloco": _diloco_on_replicas}


@register("hierarchical+auto", StrategyInfo("hierarchical+auto", SyncKind.HOOK, levels=2, auto=True,
                                           options=OptionSet.AUTO, heals_in_place=True))
def _hierarchical_auto(ddp_model: DistributedDataParallel, **options: Any) -> SyncHandle:
    return _auto(ddp_model, hierarchical=True, **options)
