"""Which codec each bucket goes through, as the hook engine's mode and ``auto``'s choices say.

The strategy's default codec for every bucket, ``auto``'s choice per bucket once it decided,
or fp32 all-reduce while the mode sends uncompressed (warm-up, observing, after a fallback);
and what follows from the codecs in use: whether the convergence guard checks them, and whether
every bucket can take the direct path (one stateless collective each). Split from
:class:`~.hooks.HookSync`, which sends the buckets and runs the control step.

Example::

    plan = CodecPlan({"powersgd": PowerSGD(rank=4)}, "powersgd", Mode.initial(False, 0))
    plan.codec_name(3), plan.summary()          # ('powersgd', 'powersgd')
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .compress.base import Codec, ErrorFeedback
from .compress.cast import Cast
from .guard import ConvergenceGuard
from .modes import Mode

if TYPE_CHECKING:
    from .auto import AutoPolicy


class CodecPlan:
    """``codecs``: codec objects by name (``"allreduce"`` is added if missing: the fallback);
    ``default``: every bucket's codec until ``auto`` (``auto``, its policy) decides otherwise;
    ``mode``: the engine's :class:`~.modes.Mode`; ``guard``: told whether the plan compresses."""

    def __init__(self, codecs: dict[str, Codec], default: str, mode: Mode, auto: AutoPolicy | None = None,
                 guard: ConvergenceGuard | None = None):
        self.codecs = dict(codecs)
        self.codecs.setdefault("allreduce", Codec())
        if default not in self.codecs:
            raise KeyError(f"default codec {default!r} not in {sorted(self.codecs)}")
        self.default = default
        self.mode = mode
        self.auto = auto
        self.guard = guard
        self.fallback_reason: str | None = None

    @property
    def decisions(self) -> dict[int, str]:
        """``auto``'s codec per bucket index (empty before its first decision, and for other strategies)."""
        return self.auto.choices if self.auto is not None else {}

    def codec_name(self, index: int) -> str:
        """The codec of bucket ``index`` in this step."""
        if self.mode.uncompressed:
            return "allreduce"
        return self.decisions.get(index, self.default)

    def names_in_use(self) -> set[str]:
        if self.mode.uncompressed:
            return {"allreduce"}
        return set(self.decisions.values()) if self.decisions else {self.default}

    def compressing(self) -> bool:
        return any(n != "allreduce" for n in self.names_in_use())

    def update_guard(self) -> None:
        """Tell the guard whether the plan compresses now (after every change of plan or mode)."""
        if self.guard is not None:
            self.guard.compressing = self.compressing()

    def guarded(self) -> bool:
        """Whether the guard checks the plan in use: only error-feedback codecs carry what it
        watches. A cast keeps nothing between steps and, like torch's bf16 hook and the plain
        ``bf16`` strategy, runs unguarded (and so on the direct path)."""
        return self.guard is not None and any(
            isinstance(self.codecs[n], ErrorFeedback) for n in self.names_in_use())

    def stateless(self) -> bool:
        """Whether every codec in use is one stateless collective (all-reduce or a cast). Only the
        codecs in use count: auto's plan of casts and all-reduce qualifies even though its
        candidates include error-feedback codecs (and so it has a guard)."""
        return all(type(self.codecs[n]) in (Codec, Cast) for n in self.names_in_use())

    def forget_residuals(self) -> None:
        """Drop what every error-feedback codec carries to the next step (a plan it belonged to ended)."""
        for codec in self.codecs.values():
            if isinstance(codec, ErrorFeedback):
                codec.forget_residuals()

    def fall_back(self, reason: str) -> None:
        """Uncompressed from the next step on, for ``reason``."""
        self.mode = self.mode.to(Mode.FALLBACK)
        self.fallback_reason = reason
        if self.auto is not None:
            self.auto.stop_verifying()  # nothing left to verify: back to the direct path
        self.update_guard()

    def summary(self, level: str | None = None) -> str:
        """The codecs in use, counted over buckets: ``"allreduce:3,powersgd:2"``; with ``level``
        (where ``auto`` chooses the level too) the level follows: ``"... on hierarchical"``."""
        if not self.decisions:
            summary = self.default if self.mode is not Mode.OBSERVE else "allreduce (observing)"
        else:
            summary = ",".join(f"{k}:{v}" for k, v in sorted(Counter(self.decisions.values()).items()))
        return f"{summary} on {level}" if level is not None else summary


__all__ = ["CodecPlan"]
