"""The hook engine's state as others read it: the figures :meth:`~.hooks.HookSync.stats` gives
the metrics, and the checkpoint state :meth:`~.hooks.HookSync.state_dict` writes and
:meth:`~.hooks.HookSync.load_state_dict` reads back.

One format, kept here apart from the engine that sends buckets: a checkpoint written by any
earlier version must still load (keys added since are read with a default), so the format is
changed in one place and read in the same one.

Example::

    saved = state_dict(engine)            # {"name": "powersgd", "steps": 12, "mode": "run", ...}
    load_state_dict(other_engine, saved, take_saved_link=False)
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from .levels import FLAT, HIERARCHICAL
from .modes import Mode
from .probe import link_from_state, link_state

HookSync = Any
"""A :class:`~.hooks.HookSync` (hooks imports this module; an import back, even for types, is a cycle
the import contracts refuse)."""

log = logging.getLogger("slipstream.sync")


def figures(engine: HookSync) -> dict[str, Any]:
    """What ``engine.stats()`` gives the metrics recorder: the last synchronising step's
    accounting (waits for that step's events: called on log steps only), the plan and why."""
    out: dict[str, Any] = {"sync_strategy": engine.name, "sync_mode": engine.mode.value}
    out.update(engine.ledger.figures(engine.clock))
    out["sync_decision"] = engine.decision_summary()
    out["sync_level"] = engine.level
    if engine.auto is not None:
        out.update(engine.auto.figures())
    if engine.verification:
        out["sync_verification"] = engine.verification
    if engine.fallback_reason:
        out["sync_fallback_reason"] = engine.fallback_reason
    if engine.guard is not None and engine.guard.last_error_ratio is not None:
        out["sync_error_ratio"] = engine.guard.last_error_ratio
    return out


def state_dict(engine: HookSync) -> dict[str, Any]:
    """Per-rank state of ``engine``: counters, mode and plan, every codec's state, the guard's,
    and for ``auto`` the probed link every rank decides from and a verification under way."""
    auto = engine.auto
    return {
        "name": engine.name,
        "steps": engine.steps,
        "mode": engine.mode.value,
        "default": engine.plan.default,
        "decisions": dict(engine.decisions),
        "fallback_reason": engine.fallback_reason,
        "verification": engine.verification,
        "level": engine.level,
        "flat_choices": dict(auto.flat_choices) if auto is not None and auto.flat_choices else None,
        "hierarchical_off": auto.hierarchical_off if auto is not None else None,
        "bytes_sent_total": engine.bytes_sent_total,
        "codecs": {k: c.state_dict() for k, c in engine.codecs.items()},
        "guard": engine.guard.state_dict() if engine.guard is not None else None,
        # auto: the probed link every rank decides from, and a verification under way
        "link": link_state(auto.link) if auto is not None else None,
        "auto_window": auto.window_state() if auto is not None else None,
    }


def load_state_dict(engine: HookSync, state: dict[str, Any], take_saved_link: bool) -> list[torch.Tensor]:
    """Restore ``state`` (:func:`state_dict`'s) into ``engine``; returns the codec state tensors
    it allocated, for the engine to record on the stream its codecs run on.

    ``take_saved_link``: healing in place, every rank goes back to the snapshot's link (a
    replacement probed none; a survivor may have re-probed in the failed step). Otherwise a run
    started afresh keeps what it probed at start, on the link it runs on now (so does an older
    state's load)."""
    if state.get("name") != engine.name:
        raise ValueError(f"sync state is for strategy {state.get('name')!r}, this run uses {engine.name!r}")
    engine.ledger.steps = int(state["steps"])
    plan, auto = engine.plan, engine.auto
    plan.mode = Mode(state["mode"])  # restored as saved: not a transition
    plan.default = state["default"]
    if auto is not None:
        auto.choices = {int(k): v for k, v in state["decisions"].items()}
        auto.verification = state.get("verification")
        flat = state.get("flat_choices")
        auto.flat_choices = {int(k): v for k, v in flat.items()} if flat else None
        auto.hierarchical_off = state.get("hierarchical_off")
        if state.get("link") is not None and (take_saved_link or auto.link is None):
            auto.link = link_from_state(state["link"])
        auto.load_window_state(state.get("auto_window"))
    _load_level(engine, state.get("level"))
    plan.fallback_reason = state.get("fallback_reason")
    engine.ledger.bytes_sent_total = float(state.get("bytes_sent_total", 0.0))
    for k, sd in state["codecs"].items():
        if k in engine.codecs:
            # Residuals and Q factors live where the gradients do: a checkpoint
            # written on another device (or loaded to the CPU) is moved here once.
            engine.codecs[k].load_state_dict(_to_device(sd, engine.device))
    for c in engine.codecs.values():
        c.reset_signal()  # a saved step's norms were checked and reset by the guard already
    if engine.guard is not None and state.get("guard") is not None:
        engine.guard.load_state_dict(state["guard"])
    return [t for c in engine.codecs.values() for t in c.state_tensors()]


def _load_level(engine: HookSync, level: str | None) -> None:
    """The saved level, where ``auto`` chooses it (a state without one was flat: ``auto``
    reduced flat before it chose levels). Elsewhere the reducer is the strategy's."""
    if engine.levels is None or engine.auto is None:
        if level == HIERARCHICAL and engine.level == FLAT and dist.get_rank() == 0:
            log.warning("sync %s: the saved state reduced in two levels; this topology has one: reducing flat",
                        engine.name)
        return
    level = level or FLAT
    if level not in engine.levels:
        raise ValueError(f"sync state has level {level!r}; known: {', '.join(engine.levels)}")
    engine.auto.level = level
    engine.groups.use(level)


def _to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` (dicts, lists, tuples of tensors and plain values) with every tensor on ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_device(v, device) for v in tree)
    return tree


__all__ = ["figures", "load_state_dict", "state_dict"]
