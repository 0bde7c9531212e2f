"""The hook engine's groups: the reducer it reduces with now, the two levels ``auto`` may choose
between, and the control wire its agreements go on; and what healing in place does to them.

Split from :class:`~.hooks.HookSync`, which sends buckets and keeps the plan: every group the
engine holds lives here, so letting go of them all (:meth:`EngineGroups.leave`) and forming
them again (:meth:`EngineGroups.rejoin`) cannot miss one.

Example::

    g = groups()
    held = EngineGroups(FlatReducer(g.flat), ControlWire(g.control))
    held.reducer.reduce(flat, codec, key, layout); held.level     # 'flat'
"""

from __future__ import annotations

from typing import Any

from ..network.link import Link
from .control import ControlWire
from .hierarchical import FlatReducer, Hierarchical
from .levels import FLAT, HIERARCHICAL
from .probe import probe_link

Reducer = FlatReducer | Hierarchical


class EngineGroups:
    """``reducer``: how a codec's collectives are laid out now (FlatReducer or Hierarchical).
    ``levels``: where ``auto`` chooses between flat and hierarchical reduction, the reducer of
    each (``{"flat": reducer, "hierarchical": Hierarchical}``); None elsewhere.
    ``control``: the gloo control group's wire (guard votes, auto's figures)."""

    def __init__(self, reducer: Reducer, control: ControlWire, levels: dict[str, Reducer] | None = None,
                 auto: bool = False):
        if levels is not None:
            if not auto:
                raise ValueError("levels: only auto chooses between flat and hierarchical reduction")
            if set(levels) != {FLAT, HIERARCHICAL} or levels[FLAT] is not reducer:
                raise ValueError("levels must map 'flat' (the reducer given) and 'hierarchical' to their reducers")
        self.reducer = reducer
        self.levels = levels
        self.control = control

    @property
    def level(self) -> str:
        """How buckets are reduced now: ``"flat"`` (one group of all ranks) or ``"hierarchical"``."""
        return HIERARCHICAL if isinstance(self.reducer, Hierarchical) else FLAT

    @property
    def local_rank(self) -> int:
        """This rank's place in its node where a level reduces in two steps (0 elsewhere): with
        two levels each rank of a node times the codecs on its own shard (``auto``)."""
        hierarchical = self.levels[HIERARCHICAL] if self.levels is not None else self.reducer
        return hierarchical.topology.local_rank if isinstance(hierarchical, Hierarchical) else 0

    def use(self, level: str) -> None:
        """Reduce on ``level`` from the next bucket on, where there are two to choose from;
        elsewhere the reducer stays the strategy's."""
        if self.levels is not None:
            self.reducer = self.levels[level]

    def reducers(self) -> list[Reducer]:
        """Every reducer the engine may use (one, or ``auto``'s two levels), each once."""
        out: list[Reducer] = [self.reducer]
        for r in (self.levels or {}).values():
            if not any(r is o for o in out):
                out.append(r)
        return out

    def probe_flat(self, device: Any) -> Link:
        """The default prober: the reducer's data group, agreed on the control group."""
        group = self.reducer.wire.group if isinstance(self.reducer, FlatReducer) else None
        return probe_link(group, device=device, control=self.control)

    def leave(self) -> None:
        """Healing in place, after the default group was destroyed: let go of every group held,
        the cached ones of :func:`.topology.groups` included, so their sockets close and no peer
        waits on them. No collective."""
        from .topology import forget

        for reducer in self.reducers():
            reducer.let_go()
        self.control = ControlWire(None)
        forget()

    def rejoin(self) -> None:
        """The default group was formed again: build the topology's groups again, in the same
        order on every rank (a collective), and move every reducer and the control wire onto them."""
        from .topology import forget, groups

        forget()
        g = groups()
        for reducer in self.reducers():
            reducer.regroup(g)
        self.control = ControlWire(g.control)


__all__ = ["EngineGroups", "Reducer"]
