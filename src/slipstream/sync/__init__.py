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
``hierarchical+auto``  two levels; probes both links, and picks per bucket the codec of the inter-node step
=====================  ==================================================================

Every strategy but ``allreduce`` runs through :mod:`.hooks`, which keeps one
global collective order (see there). The returned state has ``stats()``,
``state_dict()``/``load_state_dict()``, and (hook strategies) ``observe_loss()``
and ``request_probe()``.

Example::

    from slipstream import sync
    sync.is_valid("hierarchical+powersgd")     # True
    state = sync.apply("powersgd", ddp_model, rank=8)
    state.stats()["sync_compression_ratio"]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .compress import CODECS, make_codec
from ..link import Link, allreduce_bytes

if TYPE_CHECKING:
    # torch is imported where a strategy is applied, not here: the names above
    # (available, is_valid) are read by config checks and `slipstream validate`,
    # which should not pay for importing torch.
    import torch
    from torch.nn.parallel import DistributedDataParallel

_Strategy = Callable[..., "SyncHandle"]  # fn(ddp_model, **options) -> state
_REGISTRY: dict[str, _Strategy] = {}

# Options each strategy understands, besides the guard's (guard, max_error_ratio, check_every_steps,
# loss_window, loss_tolerance).
_CODEC_OPTIONS = {
    "powersgd": ("rank", "min_compression", "error_feedback", "warm_start", "seed"),
    "topk": ("density",),
    "sign": ("chunk_numel",),
}
_GUARD_OPTIONS = ("max_error_ratio", "check_every_steps", "loss_window", "loss_tolerance")


def register(name: str) -> Callable[[_Strategy], _Strategy]:
    """Register ``fn(ddp_model, **options) -> state`` under ``name``."""

    def deco(fn: _Strategy) -> _Strategy:
        _REGISTRY[name] = fn
        return fn

    return deco


def available() -> tuple[str, ...]:
    """Every valid strategy name, combinations (``hierarchical+powersgd``) included."""
    combos = tuple(f"hierarchical+{c}" for c in CODECS if c != "allreduce")
    return tuple(_REGISTRY) + combos


def is_valid(name: str) -> bool:
    """Whether ``name`` is a strategy :func:`apply` accepts."""
    return name in available()


class SyncHandle(Protocol):
    """What :func:`apply` returns: the installed strategy's state, as the training loop uses it.

    :class:`AllreduceState` (DDP's reducer, untouched) and
    :class:`~slipstream.sync.hooks.HookSync` (every hook strategy) implement it;
    the concrete object is returned, so a caller that knows the strategy may
    read more of it (``HookSync.decisions``, ``request_probe()``).
    """

    name: str

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

    def close(self) -> None:
        """Stop background work (the hook engine's completion thread); idempotent."""
        ...


def apply(name: str, ddp_model: DistributedDataParallel, **options: Any) -> SyncHandle:
    """Install strategy ``name`` on ``ddp_model``; returns its state (a :class:`SyncHandle`).

    Collective: every rank calls it, right after wrapping the model in DDP and
    before the first forward.

    Example::

        handle = sync.apply("bf16", ddp_model)
        handle.stats()["sync_compression_ratio"]   # 2.0
    """
    if name in _REGISTRY:
        return _REGISTRY[name](ddp_model, **options)
    if name.startswith("hierarchical+") and name.split("+", 1)[1] in CODECS:
        return _hook_strategy(name, ddp_model, name.split("+", 1)[1], hierarchical=True, **options)
    raise KeyError(f"unknown sync strategy {name!r}; known: {', '.join(available())}")


class AllreduceState:
    """Accounting for DDP's built-in reducer (no hook: nothing is added to its hot path).

    Bytes per step are the ring all-reduce payload of all gradients, 2(n-1)/n * S,
    counted once per synchronising backward.
    """

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
            "sync_decision": "allreduce (DDP reducer)",
        }

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))

    def observe_loss(self, loss: float | torch.Tensor) -> None:
        """No convergence guard here (nothing is compressed): nothing to observe."""

    def close(self) -> None:
        """Nothing runs in the background."""


def _split_options(codec: str, options: dict[str, Any]) -> tuple[dict, dict, dict]:
    mine = set(_CODEC_OPTIONS.get(codec, ()))
    codec_opts = {k: v for k, v in options.items() if k in mine}
    guard_opts = {k: v for k, v in options.items() if k in _GUARD_OPTIONS}
    rest = {k: v for k, v in options.items() if k not in mine and k not in _GUARD_OPTIONS}
    return codec_opts, guard_opts, rest


def _single_rank(ddp_model: DistributedDataParallel) -> bool:
    """One rank: nothing to synchronise, so nothing to compress (a codec would only lose
    accuracy); DDP's reducer is left as it is."""
    import logging

    import torch.distributed as dist

    if dist.get_world_size() > 1:
        return False
    logging.getLogger("slipstream.sync").info("sync: one rank, nothing to synchronise: DDP's reducer left as is")
    return True


def _make_guard(enabled: bool, guard_opts: dict[str, Any]):
    from .guard import ConvergenceGuard

    return ConvergenceGuard(**guard_opts) if enabled else None


def _hook_strategy(name: str, ddp_model: DistributedDataParallel, codec: str, hierarchical: bool = False,
                   **options: Any):
    from .control import ControlWire
    from .hierarchical import FlatReducer, Hierarchical
    from .hooks import HookSync
    from .probe import probe_link
    from .topology import groups

    codec_opts, guard_opts, rest = _split_options(codec, options)
    guard_on = rest.pop("guard", True)
    warmup_steps = int(rest.pop("warmup_steps", 0))
    if rest:
        raise TypeError(f"sync strategy {name!r} got unknown options: {', '.join(sorted(rest))}")
    if _single_rank(ddp_model):
        return AllreduceState(ddp_model, name)
    g = groups()
    reducer = Hierarchical(g) if hierarchical else FlatReducer(g.flat)
    c = make_codec(codec, **codec_opts)
    guard = _make_guard(guard_on and c.error_feedback, guard_opts)
    device = _model_device(ddp_model)
    prober = (lambda: _probe_levels(g, device)) if hierarchical else (
        lambda: probe_link(g.flat, device=device, control=ControlWire(g.control)))
    return HookSync(name, reducer, {codec: c}, codec, control_group=g.control, guard=guard,
                    warmup_steps=warmup_steps, prober=prober).install(ddp_model)


@register("allreduce")
def _allreduce(ddp_model: DistributedDataParallel, **options: Any) -> AllreduceState:
    if options:
        raise TypeError(f"sync strategy 'allreduce' takes no options, got {', '.join(sorted(options))}")
    return AllreduceState(ddp_model)


def _codec_strategy(codec: str) -> _Strategy:
    def strategy(ddp_model: DistributedDataParallel, **options: Any):
        return _hook_strategy(codec, ddp_model, codec, **options)

    strategy.__name__ = f"_{codec}"
    return strategy


for _c in ("bf16", "fp16", "powersgd", "topk", "sign"):
    register(_c)(_codec_strategy(_c))


@register("hierarchical")
def _hierarchical(ddp_model: DistributedDataParallel, **options: Any):
    return _hook_strategy("hierarchical", ddp_model, "allreduce", hierarchical=True, **options)


def _probe_group(group: Any, ranks: int, device: torch.device) -> Any:
    """One level's link, timed on its data group. Its figures are not agreed here:
    :func:`_probe_levels` takes the slowest over all ranks right after."""
    from .probe import probe_link

    if ranks <= 1:
        return Link.measured(1, 0.0, float("inf"))
    return probe_link(group, device=device, control=_OneRank())


class _OneRank:
    """A control wire that agrees with itself (figures agreed job-wide later)."""

    size = 1

    def agree(self, values: Any, op: Any = None) -> list[float]:
        return list(values)


def _model_device(ddp_model: DistributedDataParallel) -> torch.device:
    """Where the model's gradients live: the device of every data collective."""
    import torch

    for p in ddp_model.module.parameters():
        return p.device
    return torch.device("cpu")


def _probe_levels(g: Any, device: torch.device) -> Any:
    """Both links of a two-level topology, agreed on every rank (the slowest figures).

    Collective on every rank: each node probes its own intra group, each local
    index its inter group, then one all-reduce MAX on the control group makes the
    figures (and so every decision taken from them) identical everywhere.
    """
    import torch.distributed as dist

    from .control import ControlWire
    from .policy import HierarchicalCost

    topo = g.topology
    control = ControlWire(g.control)
    intra = _probe_group(g.intra, topo.local_world_size, device)
    inter = _probe_group(g.inter, topo.num_nodes, device)
    a1, inv1, a2, inv2 = control.agree(
        [intra.alpha_s, 1 / intra.bytes_per_s, inter.alpha_s, 1 / inter.bytes_per_s], op=dist.ReduceOp.MAX)
    intra = Link.measured(intra.ranks, a1, 1 / inv1 if inv1 > 0 else float("inf"), intra.samples)
    inter = Link.measured(inter.ranks, a2, 1 / inv2 if inv2 > 0 else float("inf"), inter.samples)
    return HierarchicalCost(intra, inter, topo.local_world_size, topo.num_nodes)


@register("auto")
def _auto(ddp_model: DistributedDataParallel, candidates: tuple[str, ...] = ("allreduce", "bf16", "powersgd"),
          observe_steps: int = 3, hidden_tolerance: float = 0.05, verify_steps: int = 5,
          hierarchical: bool = False, **options: Any):
    """Probe the link now; observe ``observe_steps`` uncompressed steps; decide per bucket.

    ``hierarchical=True`` (the ``hierarchical+auto`` strategy): two-level reduction, both
    levels probed, and the per-bucket choice is the codec of the inter-node step.
    After a plan that compresses, ``verify_steps`` steps under it are timed and compared
    with the uncompressed steps observed before; not faster -> back to all-reduce (logged,
    and in ``stats()["sync_verification"]``).
    """
    from .control import ControlWire
    from .guard import ConvergenceGuard
    from .hierarchical import FlatReducer, Hierarchical
    from .hooks import HookSync
    from .probe import probe_link
    from .topology import groups

    if verify_steps < 0:
        raise ValueError(f"verify_steps must be >= 0 (0: do not verify), got {verify_steps}")
    guard_on = options.pop("guard", True)
    guard_opts = {k: options.pop(k) for k in list(options) if k in _GUARD_OPTIONS}
    per_codec: dict[str, dict[str, Any]] = {c: {} for c in candidates}
    for c in candidates:
        for k in _CODEC_OPTIONS.get(c, ()):
            if k in options:
                per_codec[c][k] = options[k]
    used = {k for opts in per_codec.values() for k in opts}
    unknown = set(options) - used
    if unknown:
        raise TypeError(f"sync strategy 'auto' got unknown options: {', '.join(sorted(unknown))}")
    if "allreduce" not in candidates:
        candidates = ("allreduce", *candidates)
    if _single_rank(ddp_model):
        return AllreduceState(ddp_model, "hierarchical+auto" if hierarchical else "auto")
    g = groups()
    device = _model_device(ddp_model)
    if hierarchical:
        reducer, prober = Hierarchical(g), (lambda: _probe_levels(g, device))
    else:
        reducer, prober = FlatReducer(g.flat), (lambda: probe_link(g.flat, device=device,
                                                                   control=ControlWire(g.control)))
    link = prober()
    codecs = {c: make_codec(c, **per_codec.get(c, {})) for c in candidates}
    guard = ConvergenceGuard(**guard_opts) if guard_on else None
    policy = {"candidates": candidates, "observe_steps": observe_steps, "hidden_tolerance": hidden_tolerance,
              "verify_steps": verify_steps,
              "options": per_codec}
    name = "hierarchical+auto" if hierarchical else "auto"
    state = HookSync(name, reducer, codecs, "allreduce", control_group=g.control, guard=guard,
                     policy=policy, link=link, prober=prober)
    import logging

    import torch.distributed as dist

    if dist.get_rank() == 0:
        logging.getLogger("slipstream.sync").info("sync %s: probed link: %s", name, link.summary())
    return state.install(ddp_model)


@register("hierarchical+auto")
def _hierarchical_auto(ddp_model: DistributedDataParallel, **options: Any):
    return _auto(ddp_model, hierarchical=True, **options)
