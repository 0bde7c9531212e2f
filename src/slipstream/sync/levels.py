"""Flat or two-level reduction: which one ``auto`` uses where the topology has both.

``auto`` on a topology with more than one node *and* more than one rank per node
(:func:`has_two_levels`) builds both reducers (:class:`~.hierarchical.FlatReducer`
over all ranks, :class:`~.hierarchical.Hierarchical` in two levels) and probes both
at ``apply`` time: the flat group's link, and the node and inter-node links
(:class:`LevelLinks`). At its decision it runs :func:`.policy.decide` once per
level, each on its own cost model and on codec costs measured on that level's codec
input (a hierarchical codec compresses the 1/k shard), and :func:`choose_level`
takes the level whose predicted step is lower (a tie goes to flat, the level the
uncompressed steps were observed on). The figures are agreed across ranks before
either decision, so every rank takes the same level.

Where the topology has one level only, nothing of this runs: ``auto`` is flat
(one node, or one rank per node, where the two-level reducer is a flat one).

Example::

    links = LevelLinks(flat=probe_link(g.flat), hierarchical=probe_levels(g))
    choose_level({"flat": 0.081, "hierarchical": 0.095})     # 'flat'
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..network.link import Link
from .policy import HierarchicalCost

FLAT = "flat"
HIERARCHICAL = "hierarchical"
LEVELS = (FLAT, HIERARCHICAL)


def has_two_levels(topology: Any) -> bool:
    """Whether ``topology`` (a :class:`~.topology.Topology`) has both levels: several nodes of several ranks."""
    return topology.num_nodes > 1 and topology.local_world_size > 1


@dataclass(frozen=True)
class LevelLinks:
    """Both levels' measured links: the flat group's, and the node + inter-node pair.

    ``auto`` holds one as its link where it chooses the level; :meth:`model` is the
    cost model :func:`.policy.decide` takes for one level.
    """

    flat: Link
    hierarchical: HierarchicalCost

    def model(self, level: str) -> Link | HierarchicalCost:
        if level not in LEVELS:
            raise ValueError(f"unknown reduction level {level!r}; known: {', '.join(LEVELS)}")
        return self.flat if level == FLAT else self.hierarchical

    def summary(self) -> str:
        return f"flat {self.flat.summary()}; hierarchical: {self.hierarchical.summary()}"


def choose_level(predicted_s: Mapping[str, float]) -> str:
    """The level whose predicted step (seconds) is lower; a tie goes to flat.

    Example::

        choose_level({"flat": 0.120, "hierarchical": 0.090})   # 'hierarchical'
        choose_level({"flat": 0.100, "hierarchical": 0.100})   # 'flat'
    """
    return HIERARCHICAL if predicted_s[HIERARCHICAL] < predicted_s[FLAT] else FLAT


def explain_level(level: str, predicted_s: Mapping[str, float], links: LevelLinks) -> str:
    """One log line: the level taken and both predictions behind it."""
    other = HIERARCHICAL if level == FLAT else FLAT
    return (f"level {level}: predicted {predicted_s[level] * 1e3:.1f} ms per backward+sync against "
            f"{predicted_s[other] * 1e3:.1f} ms {other} ({links.summary()})")


__all__ = ["FLAT", "HIERARCHICAL", "LEVELS", "LevelLinks", "choose_level", "explain_level", "has_two_levels"]
