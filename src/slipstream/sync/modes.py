"""The hook engine's mode: an explicit state with documented transitions.

=========  =====================================================  ==========================================
mode       what every bucket does                                  leaves it for
=========  =====================================================  ==========================================
OBSERVE    uncompressed all-reduce, timed (``auto`` only)          RUN when ``observe_steps`` steps are in
                                                                   and the plan is decided; FALLBACK
WARMUP     uncompressed all-reduce (``warmup_steps`` > 0)          RUN after ``warmup_steps`` steps; FALLBACK
RUN        its codec (the strategy's, or ``auto``'s per bucket)    OBSERVE on ``request_probe()`` (``auto``:
                                                                   observe again, decide anew); FALLBACK
FALLBACK   uncompressed all-reduce, for the rest of the run        (none: one-way)
=========  =====================================================  ==========================================

Every transition happens at the same step on every rank: it follows from the
step count, from an agreed collective (guard vote, ``auto``'s figures) or from
a call every rank makes at the same step (``request_probe()``, ``fallback()``).

Example::

    mode = Mode.initial(auto=False, warmup_steps=3)     # Mode.WARMUP
    mode = mode.to(Mode.RUN)
    mode == "run"                                       # True: a str enum
"""

from __future__ import annotations

from enum import Enum


class Mode(str, Enum):
    OBSERVE = "observe"
    WARMUP = "warmup"
    RUN = "run"
    FALLBACK = "fallback"

    @classmethod
    def initial(cls, auto: bool, warmup_steps: int) -> Mode:
        """The first mode: OBSERVE for ``auto``, WARMUP with warm-up steps, else RUN."""
        if auto:
            return cls.OBSERVE
        return cls.WARMUP if warmup_steps else cls.RUN

    @property
    def uncompressed(self) -> bool:
        """Whether every bucket goes uncompressed in this mode, whatever the plan."""
        return self is not Mode.RUN

    def to(self, new: Mode) -> Mode:
        """``new``, if the table above allows the move; ValueError otherwise."""
        if new not in TRANSITIONS[self]:
            raise ValueError(f"sync mode cannot go from {self.value} to {new.value}; "
                             f"allowed: {', '.join(m.value for m in TRANSITIONS[self]) or 'none'}")
        return new

    def __str__(self) -> str:
        return self.value


TRANSITIONS: dict[Mode, frozenset[Mode]] = {
    Mode.OBSERVE: frozenset({Mode.RUN, Mode.FALLBACK}),
    Mode.WARMUP: frozenset({Mode.RUN, Mode.FALLBACK}),
    Mode.RUN: frozenset({Mode.OBSERVE, Mode.FALLBACK}),
    Mode.FALLBACK: frozenset({Mode.FALLBACK}),  # a second fallback (another reason) stays there
}

__all__ = ["Mode", "TRANSITIONS"]
