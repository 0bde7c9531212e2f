"""The options of a sync strategy: one frozen dataclass, the one place each default lives.

``sync.apply(name, ddp_model, **options)`` (and ``sync_options`` in the
config) take flat keyword options; :meth:`SyncOptions.parse` checks them
against what strategy ``name`` understands and turns them into a
:class:`SyncOptions`. The engine, the convergence guard and ``auto``'s policy
read their settings from it, and :class:`~.guard.ConvergenceGuard` takes its
constructor defaults from :data:`DEFAULTS`, so no default is written twice.
A codec's own options (``rank``, ``density``, ...) keep their defaults in the
codec's constructor (``compress/``): they are passed on only when given.

Fields, grouped as torch's PowerSGDState groups its own:

* convergence guard (on for codecs with error feedback): ``guard``,
  ``check_every_steps``, ``max_error_ratio``, ``loss_window``, ``loss_tolerance``;
* schedule: ``warmup_steps`` uncompressed first steps (codec strategies);
* ``auto``: ``candidates``, ``observe_steps``, ``hidden_tolerance``, ``verify_steps``,
  ``min_retained``;
* ``diloco``: ``inner_steps``, ``outer_lr``, ``outer_momentum``, ``outer_nesterov``,
  ``fragments``, ``outer_codec`` (it takes no other option: nothing is compressed per step);
* ``codec_options``: per codec name, the options given for it.

Example::

    opts = SyncOptions.parse("auto", {"observe_steps": 2, "rank": 8})
    opts.observe_steps, opts.codec_kwargs("powersgd")      # 2, {'rank': 8}
    SyncOptions().loss_window                              # 20
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import ConfigError, did_you_mean
from . import describe
from .strategies import OptionSet, StrategyInfo, UnknownStrategy

# The options each codec's constructor takes (its defaults stay there).
CODEC_OPTION_NAMES: dict[str, tuple[str, ...]] = {
    "powersgd": ("rank", "min_compression", "error_feedback", "warm_start", "seed"),
    "topk": ("density",),
    "sign": ("chunk_numel",),
}
GUARD_OPTION_NAMES = ("guard", "check_every_steps", "max_error_ratio", "loss_window", "loss_tolerance")
AUTO_OPTION_NAMES = ("candidates", "observe_steps", "hidden_tolerance", "verify_steps", "verify_min_gain",
                     "verify_runner_up", "min_retained")
CODEC_STRATEGY_OPTION_NAMES = ("warmup_steps",)
DILOCO_OPTION_NAMES = ("inner_steps", "outer_lr", "outer_momentum", "outer_nesterov", "fragments", "outer_codec",
                       "overlap_steps", "overlap_mix")
DILOCO_CODECS = ("none", "bf16", "fp16")
"""What ``outer_codec`` takes: the pseudo-gradient as it is, or cast to 16 bits for its all-reduce."""


class SyncOptionsError(ConfigError, TypeError):
    """An option a sync strategy does not take, or a value it refuses.

    A :class:`~slipstream.errors.ConfigError` (one line, exit 2, before any worker starts
    when the launcher checks it) and, as before, a ``TypeError`` for an unknown name."""


@dataclass(frozen=True)
class SyncOptions:
    """Every setting of the hook engine, with its default (see the module docstring)."""

    # -- convergence guard: tune these -----------------------------------------------
    guard: bool = True
    """Check convergence while an error-feedback codec compresses (no effect on casts)."""
    check_every_steps: int = 10
    """Steps between the guard's checks (one tiny all-reduce each)."""
    max_error_ratio: float = 20.0
    """Fall back when the error-feedback residual exceeds this many gradient norms."""
    loss_window: int = 20
    """Compressed steps whose mean loss is compared with the uncompressed steps'."""
    loss_tolerance: float = 0.10
    """Fall back when that mean is higher by more than this fraction."""

    # -- schedule ------------------------------------------------------------------------
    warmup_steps: int = 0
    """Uncompressed first steps (like torch's start_powerSGD_iter); the loss rule's baseline."""

    # -- auto: tune these -------------------------------------------------------------------
    candidates: tuple[str, ...] = ("allreduce", "bf16", "powersgd")
    """Codecs ``auto`` chooses among per bucket; ``allreduce`` is always added."""
    observe_steps: int = 1
    """Uncompressed steps ``auto`` observes (after DDP's first) before it decides. One (was
    two, and three before that): the link's figures come from the start-up probe, so the
    window only has to show when each bucket becomes ready, and a plan that compresses is
    verified over ``verify_steps`` steps anyway. With one, ``auto`` compresses from step 3,
    the step torch's PowerSGD hook starts at with ``start_powerSGD_iter=2``. Raise it where
    the first steps are not typical (a warming data pipeline, a compile)."""
    hidden_tolerance: float = 0.05
    """All-reduce predicted within this fraction of backward counts as hidden: compress nothing."""
    verify_steps: int = 5
    """Steps timed under a compressing plan before it is kept (0: do not verify)."""
    verify_min_gain: float = 0.05
    """A verified plan with an error-feedback codec (PowerSGD, top-k, sign) is kept only when it
    measured at least this fraction faster than the uncompressed steps: a lossy plan that merely
    ties all-reduce trades accuracy for nothing. A plan of casts need only be faster."""
    verify_runner_up: float = 0.15
    """Where the plan has an error-feedback codec and the best plan of casts alone is predicted
    within this fraction of it, both are verified (the casts first, ``verify_steps`` steps each)
    and the lossy plan is kept only if it measured ``verify_min_gain`` faster than the casts:
    the model's choice between two close plans is within its error on a shared machine (seen:
    GPT on 2x2 at 1 Gbit/s, PowerSGD chosen, 186 ms a step, against 173 ms for bf16). 0: off."""
    min_retained: float = 0.5
    """The convergence gate: a codec is not a candidate when one application of it keeps less
    than this fraction of the observed gradient's energy (1 - ||g - C(g)||^2 / ||g||^2, over
    all buckets, measured on the run's own averaged gradient at the decision). Error feedback
    delivers the rest later, so a low figure means most of each step's update arrives steps
    late. Measured (docs/sync.md): PowerSGD rank 4 keeps 0.75-0.90 on the MLP, 0.99-1.0 on
    GPT and 0.35-0.41 on the ResNet's early steps, where it slowed convergence in every run.
    0 turns the gate off."""

    # -- diloco: tune these ------------------------------------------------------------------
    inner_steps: int = 50
    """H: local optimizer steps between two outer steps (each replica trains alone in between).
    Bytes per step fall by H against all-reduce. 50, not the paper's 500: a run of a few
    thousand steps still gets tens of outer steps, and the DiLoCo paper (Douillard et al.
    2023, fig. 4) shows perplexity rising only slowly from H=50 to H=500, while runs here are
    short (a few hundred steps with H=500 would average the replicas once or twice)."""
    outer_lr: float = 0.7
    """The outer optimizer's learning rate on the averaged pseudo-gradient (paper: 0.7)."""
    outer_momentum: float = 0.0
    """The outer optimizer's momentum (Nesterov when ``outer_nesterov``). 0 by default, not the
    paper's 0.9: on the GPT example (2 replicas, H=50, 800 steps: 16 outer steps) 0.9 ended
    at +20.8 % held-out loss against DDP, 0.5 at +6.6 %, 0 at +1.8 % (docs/sync.md); the
    paper's setting comes from runs of tens of thousands of steps with H=500 and a small inner
    lr, where each pseudo-gradient is small. 0 with ``outer_lr`` 1 and H=1: plain parameter
    averaging every step (with inner SGD: synchronous data-parallel SGD)."""
    outer_nesterov: bool = True
    """Nesterov momentum in the outer step (the paper's outer optimizer)."""
    fragments: int = 1
    """Streaming DiLoCo: the parameters are split in this many fragments of about equal size
    (in parameter order) and fragment f is synchronised at its own step within the period
    (step t with t mod H = (f+1) H / F mod H): each outer all-reduce carries 1/F of the model,
    spread over the period instead of one burst. 1: the whole model every H steps."""
    outer_codec: str = "none"
    """How the pseudo-gradient travels: ``none`` (its own dtype), ``bf16`` or ``fp16`` (a 16-bit
    cast for the all-reduce: half the outer bytes; the outer parameters stay in full width)."""

    overlap_steps: int = 0
    """Streaming DiLoCo's overlap (tau): a fragment's outer all-reduce starts at its step and is
    applied ``overlap_steps`` optimizer steps later, while the replica goes on training, so the
    exchange hides behind that many steps of compute instead of blocking its step. 0: blocking
    (the outer step completes at the step it starts). Must be below ``inner_steps``."""
    overlap_mix: float = 0.0
    """Alpha: where a fragment's outer step lands, each parameter becomes ``alpha * local +
    (1 - alpha) * outer``. 0 (default): the replica takes the new outer value, as plain DiLoCo
    does (every replica equal right after the step); above 0 it keeps part of what it learnt
    meanwhile (useful with ``overlap_steps``; the replicas then never become equal)."""

    # -- codecs ------------------------------------------------------------------------------
    codec_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per codec name, the constructor options given for it (defaults: the codec's own)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "warmup_steps", int(self.warmup_steps))
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.verify_steps < 0:
            raise ConfigError(f"verify_steps must be >= 0 (0: do not verify), got {self.verify_steps}")
        if self.observe_steps < 1:
            raise ConfigError(f"observe_steps must be >= 1, got {self.observe_steps}")
        if not 0.0 <= self.verify_min_gain < 1.0:
            raise ConfigError(f"verify_min_gain must be in [0, 1), got {self.verify_min_gain}")
        if not 0.0 <= self.verify_runner_up < 1.0:
            raise ConfigError(f"verify_runner_up must be in [0, 1) (0: off), got {self.verify_runner_up}")
        if not 0.0 <= self.min_retained <= 1.0:
            raise ConfigError(f"min_retained must be in [0, 1] (0: no convergence gate), got {self.min_retained}")
        object.__setattr__(self, "candidates", tuple(self.candidates))
        self._check_diloco()

    def _check_diloco(self) -> None:
        if self.inner_steps < 1:
            raise ConfigError(f"inner_steps must be >= 1 (local steps between outer steps), got {self.inner_steps}")
        if not self.outer_lr > 0.0:
            raise ConfigError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if not 1 <= self.fragments <= self.inner_steps:
            raise ConfigError(f"fragments must be in [1, inner_steps({self.inner_steps})] (each fragment is "
                              f"synchronised at its own step of the period), got {self.fragments}")
        object.__setattr__(self, "overlap_steps", int(self.overlap_steps))
        if not 0 <= self.overlap_steps < self.inner_steps:
            raise ConfigError(f"overlap_steps must be in [0, inner_steps({self.inner_steps})) (a fragment's outer "
                              f"step lands before the fragment's next one starts), got {self.overlap_steps}")
        if not 0.0 <= self.overlap_mix < 1.0:
            raise ConfigError(f"overlap_mix must be in [0, 1) (the share of the local value kept), got {self.overlap_mix}")
        if self.outer_codec not in DILOCO_CODECS:
            raise ConfigError(f"outer_codec must be one of {', '.join(DILOCO_CODECS)}, got {self.outer_codec!r}"
                              + did_you_mean(str(self.outer_codec), DILOCO_CODECS, quote=True))

    def codec_kwargs(self, codec: str) -> dict[str, Any]:
        """The options given for ``codec`` (empty: its constructor's defaults)."""
        return dict(self.codec_options.get(codec, {}))

    def guard_kwargs(self) -> dict[str, Any]:
        """The :class:`~.guard.ConvergenceGuard` constructor's arguments."""
        return {k: getattr(self, k) for k in GUARD_OPTION_NAMES if k != "guard"}

    @property
    def auto_candidates(self) -> tuple[str, ...]:
        """``candidates`` with ``allreduce`` first when it was left out (the fallback of every bucket)."""
        return self.candidates if "allreduce" in self.candidates else ("allreduce", *self.candidates)

    @classmethod
    def parse(cls, strategy: str, options: Mapping[str, Any]) -> SyncOptions:
        """Check flat ``options`` against what ``strategy`` takes; the typed settings.

        ``strategy``: a codec strategy (``powersgd``, ``hierarchical+topk``,
        ``hierarchical``...) or ``auto`` / ``hierarchical+auto``. Raises TypeError
        naming the options it does not take.

        Example::

            SyncOptions.parse("powersgd", {"rank": 2, "warmup_steps": 3}).warmup_steps   # 3
        """
        info = _find(strategy)
        family = info.options if info is not None else OptionSet.CODEC
        options = dict(options)
        if family is OptionSet.AUTO:
            codecs = tuple(options.get("candidates", cls.candidates))
            allowed = set(GUARD_OPTION_NAMES) | set(AUTO_OPTION_NAMES)
        elif family is OptionSet.DILOCO:
            codecs, allowed = (), set(DILOCO_OPTION_NAMES)
        else:
            # A name nothing is registered under is read as a codec's (as it always was).
            codec = info.codec if info is not None else strategy
            codecs = () if codec in (None, "allreduce") else (codec,)
            allowed = set(GUARD_OPTION_NAMES) | set(CODEC_STRATEGY_OPTION_NAMES)
        per_codec: dict[str, dict[str, Any]] = {}
        for c in codecs:
            given = {k: options[k] for k in CODEC_OPTION_NAMES.get(c, ()) if k in options}
            if given:
                per_codec[c] = given
        used = {k for opts in per_codec.values() for k in opts}
        unknown = set(options) - allowed - used
        if unknown:
            takes = sorted(allowed | {k for c in codecs for k in CODEC_OPTION_NAMES.get(c, ())})
            named = [name + did_you_mean(name, takes, quote=True) for name in sorted(unknown)]
            raise SyncOptionsError(f"sync strategy {strategy!r} got unknown options: {', '.join(named)}; "
                                   f"it takes: {', '.join(takes)}")
        own = {f.name for f in fields(cls)} - {"codec_options"}
        return cls(**{k: v for k, v in options.items() if k in own}, codec_options=per_codec)


def check_sync_options(strategy: str, options: Mapping[str, Any]) -> None:
    """Raise :class:`SyncOptionsError` when ``options`` are not what ``strategy`` takes.

    Pure (no torch, no process group): ``slipstream run`` calls it, through the
    configuration check, before any worker starts. A strategy not built in is not checked.

    Example::

        check_sync_options("powersgd", {"rnk": 4})
        # SyncOptionsError: sync strategy 'powersgd' got unknown options: rnk (did you mean 'rank'?); ...
    """
    info = _find(strategy)
    if info is None or info.options is OptionSet.OWN:  # a user's strategy checks its own
        return
    if info.options is OptionSet.NONE:
        if options:
            raise SyncOptionsError(f"sync strategy {strategy!r} takes no options, got {', '.join(sorted(options))}")
        return
    for f in fields(SyncOptions):
        if f.name in options and isinstance(getattr(DEFAULTS, f.name), (bool, int, float)):
            value, default = options[f.name], getattr(DEFAULTS, f.name)
            kind = bool if isinstance(default, bool) else (int if isinstance(default, int) else (int, float))
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                rule = {bool: "true or false", int: "a whole number"}.get(kind, "a number")  # type: ignore[arg-type]
                raise SyncOptionsError(f"sync_options {f.name} must be {rule}, got {value!r}")
    try:
        SyncOptions.parse(strategy, options)
    except SyncOptionsError:
        raise
    except (TypeError, ValueError) as exc:  # a value of the wrong type ("observe_steps": "two")
        raise SyncOptionsError(f"sync_options for {strategy!r}: {exc}") from None


def _find(strategy: str) -> StrategyInfo | None:
    """The description of ``strategy``, or None where nothing is registered under the name."""
    try:
        return describe(strategy)
    except UnknownStrategy:
        return None


DEFAULTS = SyncOptions()
"""Every default in one object: ``DEFAULTS.loss_window`` and so on."""

__all__ = ["AUTO_OPTION_NAMES", "CODEC_OPTION_NAMES", "DEFAULTS", "DILOCO_CODECS", "DILOCO_OPTION_NAMES", "GUARD_OPTION_NAMES", "SyncOptions",
           "SyncOptionsError", "check_sync_options"]
