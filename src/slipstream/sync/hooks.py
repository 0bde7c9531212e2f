"""The DDP-hook glue: :class:`HookSync`, the engine every hook strategy installs.

DDP hands buckets to a comm hook in bucket order, the same on every rank.
:meth:`HookSync.on_bucket` sends each bucket one of two ways:

* the **direct path**, when every bucket needs one stateless collective and
  the engine none of its own (the ``bf16``/``fp16`` casts, fp32 all-reduce in
  warm-up or after a fallback, and an ``auto`` plan of casts and all-reduce once
  it is verified): the hook
  launches one async all-reduce and chains the local decode with
  ``fut.then()``, as torch's own hooks do, with no thread in between;
* the **ordered path** otherwise (PowerSGD, top-k, sign, hierarchical
  reduction, ``auto``'s observe/verify steps, the convergence guard's checks,
  a re-probe): a job on :class:`~.ordering.OrderedQueue`, one thread per model
  that keeps one global collective order (see there for why).

The pieces live in their own modules: :mod:`.ordering` (the queue),
:mod:`.accounting` (bytes and times per step), :mod:`.modes` (the mode enum
and its transitions), :mod:`.auto` (``auto``'s observe/decide/verify loop over
:mod:`.policy`), :mod:`.probe` (link measurements), :mod:`.options` (every
setting and its default).

On GPUs the comm thread only *enqueues* on its own CUDA stream, after waiting
on the device for the event the backward recorded when the bucket became ready;
every time ``auto`` and the stats use comes from CUDA events
(:mod:`slipstream.timing`), read back only where the host waits anyway.
Agreements between ranks go on the gloo control group
(:class:`~.control.ControlWire`), data on the data groups (rule: :mod:`.topology`).

Example::

    state = HookSync("powersgd", FlatReducer(groups().flat), {"powersgd": PowerSGD(rank=4)}, "powersgd")
    state.install(ddp_model)
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..link import Link, allreduce_bytes
from ..timing import HostClock, Mark, clock_for
from .accounting import Ledger, StepRecord
from .auto import AutoPolicy
from .compress.base import Codec, ErrorFeedback, Layout, layout_from_shapes
from .compress.cast import Cast
from .control import ControlWire
from .guard import ConvergenceGuard
from .hierarchical import FlatReducer, Hierarchical
from .levels import FLAT, HIERARCHICAL
from .modes import Mode
from .options import SyncOptions
from .ordering import OrderedQueue
from .policy import Decision, FlatCost, HierarchicalCost
from .probe import link_from_state, link_state, probe_link

log = logging.getLogger("slipstream.sync")

Reducer = FlatReducer | Hierarchical
LinkModel = Link | FlatCost | HierarchicalCost


class HookSync:
    """The hook engine's state (see the module docstring); implements :class:`~slipstream.sync.SyncHandle`.

    reducer: FlatReducer or Hierarchical (how a codec's collectives are laid out).
    codecs: codec objects by name; ``default`` is used for every bucket until a
      policy decides otherwise. ``"allreduce"`` is added if missing (fallback).
    options: the settings (:class:`~.options.SyncOptions`): ``warmup_steps``, and
      for ``auto`` (``auto=True``) its observation window, candidates, verification.
    guard: convergence guard, checked while an error-feedback codec compresses.
    link: the start-up probe's figures (``auto``); prober: measures the link(s) again,
      collective on every rank, called from the comm thread.
    levels: ``auto`` where the topology has both levels: the reducer of each level
      (``{"flat": FlatReducer, "hierarchical": Hierarchical}``; ``reducer`` is the flat
      one). The engine reduces on flat until the policy's decision, then on the level
      it chose (:mod:`.levels`), from the next step.
    """

    steps_between_syncs = 1  # every optimizer step reduces on every rank

    def __init__(
        self,
        name: str,
        reducer: Reducer,
        codecs: dict[str, Codec],
        default: str,
        control_group: Any = None,
        guard: ConvergenceGuard | None = None,
        options: SyncOptions | None = None,
        auto: bool = False,
        link: LinkModel | None = None,
        prober: Callable[[], LinkModel] | None = None,
        levels: dict[str, Reducer] | None = None,
    ):
        self.name = name
        self.reducer = reducer
        if levels is not None:
            if not auto:
                raise ValueError("levels: only auto chooses between flat and hierarchical reduction")
            if set(levels) != {FLAT, HIERARCHICAL} or levels[FLAT] is not reducer:
                raise ValueError("levels must map 'flat' (the reducer given) and 'hierarchical' to their reducers")
        self.levels = levels
        self.codecs = dict(codecs)
        self.codecs.setdefault("allreduce", Codec())
        if default not in self.codecs:
            raise KeyError(f"default codec {default!r} not in {sorted(self.codecs)}")
        self.default = default
        self.options = options if options is not None else SyncOptions()
        # Host-side agreements (guard votes, auto's figures): the gloo control group.
        if control_group is None and dist.is_initialized():
            from .topology import groups

            control_group = groups().control
        self.control = ControlWire(control_group)
        self.guard = guard
        self._prober = prober if prober is not None else self._probe_flat
        self.world_size = self.control.size
        # With two levels each rank of a node times the codecs on its own shard (auto.decide_timed).
        hierarchical = levels[HIERARCHICAL] if levels is not None else reducer
        local_rank = hierarchical.topology.local_rank if isinstance(hierarchical, Hierarchical) else 0
        self.auto = (AutoPolicy(self.options, self.control, self.world_size, link, self._prober, name,
                                local_rank=local_rank) if auto else None)
        # Where the gradients live (set by install): data collectives and clocks follow it.
        self.device = torch.device("cpu")
        self.clock: Any = HostClock()
        self.mode = Mode.initial(auto, self.options.warmup_steps)
        self.fallback_reason: str | None = None
        self.ledger = Ledger()
        self._open: StepRecord | None = None
        self._layouts: dict[Hashable, Layout | None] = {}
        self._probe_requested = False
        self._t_forward_end: Mark | None = None
        self._lock = threading.Lock()
        self._param_index: dict[int, int] = {}
        self._queue: OrderedQueue | None = None
        self._queued_before = 0  # jobs of ordering queues already stopped (close(), or going direct)
        # Codec state a load allocated on the default stream, not yet recorded for the side
        # stream the codecs run on (see _job).
        self._loaded: list[torch.Tensor] = []
        self._loss_scale: Callable[[], torch.Tensor | None] | None = None  # use_loss_scale
        # Healing in place (leave/rejoined): a collective of this step failed, so the step's later
        # jobs fail at once instead of touching the broken groups; and backwards with no forward
        # before them (the bucket-order fix after a heal) pass through without communicating.
        self._broken: BaseException | None = None
        self._passthrough = False
        self._take_saved_link = False  # set by rejoined(): the next load restores auto's link too
        self._set_guard_state()

    # -- installation ------------------------------------------------------------------
    def install(self, ddp: DistributedDataParallel) -> HookSync:
        def on_forward(module: Any, args: Any, output: Any) -> None:
            self._passthrough = False
            self._t_forward_end = self.clock.mark()

        params = list(ddp.module.parameters())
        if params:
            self.device = params[0].device
        self.clock = clock_for(self.device)
        self._param_index = {id(p): i for i, p in enumerate(params)}
        ddp.module.register_forward_hook(on_forward)
        ddp.register_comm_hook(self, _hook)
        return self

    # -- what the run reads ---------------------------------------------------------------
    @property
    def steps(self) -> int:
        return self.ledger.steps

    @property
    def bytes_sent_total(self) -> float:
        return self.ledger.bytes_sent_total

    @property
    def last(self) -> StepRecord | None:
        return self.ledger.last

    @property
    def decisions(self) -> dict[int, str]:
        """``auto``'s codec per bucket index (empty before its first decision, and for other strategies)."""
        return self.auto.choices if self.auto is not None else {}

    @property
    def decision(self) -> Decision | None:
        return self.auto.decision if self.auto is not None else None

    @property
    def verification(self) -> str | None:
        return self.auto.verification if self.auto is not None else None

    @property
    def queued_jobs_total(self) -> int:
        """Jobs that went through the ordering thread so far (0: every bucket went direct)."""
        return self._queued_before + (self._queue.jobs_submitted if self._queue is not None else 0)

    # -- public API ----------------------------------------------------------------------
    def observe_loss(self, loss: float | torch.Tensor) -> None:
        """Feed this step's loss to the convergence guard (optional; a tensor stays on its
        device until the next check). Call it after backward."""
        if self.guard is not None and self.mode is not Mode.FALLBACK:
            self.guard.observe_loss(loss)

    def use_loss_scale(self, scale: Callable[[], torch.Tensor | None] | None) -> None:
        """Gradients arrive multiplied by a loss scale (fp16's GradScaler): ``scale()`` gives it
        as a 0-dim tensor on the gradients' device (None: not known yet). Error-feedback codecs
        then work in true-gradient units: a bucket is divided by the scale before the codec
        and the result multiplied back, so the residual carried to the next step does not
        change weight when the scaler changes its scale (2x at each growth or backoff). No
        host sync: the scale stays on the device. Call it on every rank, before training.

        Example::

            state.use_loss_scale(lambda: slipstream.train.precision.loss_scale(scaler))
        """
        self._loss_scale = scale

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state is the same on every rank: the shared checkpoint holds it."""

    def after_optimizer_step(self) -> None:
        """Gradients were synchronised in backward: nothing to do after the step."""

    def request_probe(self) -> None:
        """Re-measure the link (and, for auto, re-observe and re-decide) at the next step.

        Call it on every rank at the same step."""
        self._probe_requested = True

    def stats(self) -> dict[str, Any]:
        """Per-step accounting for the metrics recorder (last synchronising step)."""
        out: dict[str, Any] = {"sync_strategy": self.name, "sync_mode": self.mode.value}
        out.update(self.ledger.figures(self.clock))  # log steps only: waits for the step's events
        out["sync_decision"] = self.decision_summary()
        out["sync_level"] = self.level
        if self.auto is not None:
            out.update(self.auto.figures())
        if self.verification:
            out["sync_verification"] = self.verification
        if self.fallback_reason:
            out["sync_fallback_reason"] = self.fallback_reason
        if self.guard is not None and self.guard.last_error_ratio is not None:
            out["sync_error_ratio"] = self.guard.last_error_ratio
        return out

    @property
    def level(self) -> str:
        """How buckets are reduced now: ``"flat"`` (one group of all ranks) or ``"hierarchical"``."""
        return HIERARCHICAL if isinstance(self.reducer, Hierarchical) else FLAT

    def decision_summary(self) -> str:
        """The codecs in use, counted over buckets: ``"allreduce:3,powersgd:2"``; where ``auto``
        chooses the level too, the level follows: ``"allreduce:3,powersgd:2 on hierarchical"``."""
        if not self.decisions:
            summary = self.default if self.mode is not Mode.OBSERVE else "allreduce (observing)"
        else:
            counts: dict[str, int] = {}
            for v in self.decisions.values():
                counts[v] = counts.get(v, 0) + 1
            summary = ",".join(f"{k}:{v}" for k, v in sorted(counts.items()))
        return f"{summary} on {self.level}" if self.levels is not None else summary

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "steps": self.steps,
            "mode": self.mode.value,
            "default": self.default,
            "decisions": dict(self.decisions),
            "fallback_reason": self.fallback_reason,
            "verification": self.verification,
            "level": self.level,
            "flat_choices": dict(self.auto.flat_choices) if self.auto is not None and self.auto.flat_choices else None,
            "hierarchical_off": self.auto.hierarchical_off if self.auto is not None else None,
            "bytes_sent_total": self.bytes_sent_total,
            "codecs": {k: c.state_dict() for k, c in self.codecs.items()},
            "guard": self.guard.state_dict() if self.guard is not None else None,
            # auto: the probed link every rank decides from, and a verification under way
            "link": link_state(self.auto.link) if self.auto is not None else None,
            "auto_window": self.auto.window_state() if self.auto is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"sync state is for strategy {state.get('name')!r}, this run uses {self.name!r}")
        self.ledger.steps = int(state["steps"])
        self.mode = Mode(state["mode"])  # restored as saved: not a transition
        self.default = state["default"]
        if self.auto is not None:
            self.auto.choices = {int(k): v for k, v in state["decisions"].items()}
            self.auto.verification = state.get("verification")
            flat = state.get("flat_choices")
            self.auto.flat_choices = {int(k): v for k, v in flat.items()} if flat else None
            self.auto.hierarchical_off = state.get("hierarchical_off")
            # Healing in place, every rank goes back to the snapshot's link (a replacement probed
            # none; a survivor may have re-probed in the failed step). A run started afresh keeps
            # what it probed at start, on the link it runs on now (so does an older state's load).
            if state.get("link") is not None and (self._take_saved_link or self.auto.link is None):
                self.auto.link = link_from_state(state["link"])
            self._take_saved_link = False
            self.auto.load_window_state(state.get("auto_window"))
        self._load_level(state.get("level"))
        self.fallback_reason = state.get("fallback_reason")
        self.ledger.bytes_sent_total = float(state.get("bytes_sent_total", 0.0))
        for k, sd in state["codecs"].items():
            if k in self.codecs:
                # Residuals and Q factors live where the gradients do: a checkpoint
                # written on another device (or loaded to the CPU) is moved here once.
                self.codecs[k].load_state_dict(_to_device(sd, self.device))
        self._loaded = [t for c in self.codecs.values() for t in c.state_tensors()]
        for c in self.codecs.values():
            c.reset_signal()  # a saved step's norms were checked and reset by the guard already
        if self.guard is not None and state.get("guard") is not None:
            self.guard.load_state_dict(state["guard"])

    def _load_level(self, level: str | None) -> None:
        """The saved level, where ``auto`` chooses it (a state without one was flat: ``auto``
        reduced flat before it chose levels). Elsewhere the reducer is the strategy's."""
        if self.levels is None or self.auto is None:
            if level == HIERARCHICAL and self.level == FLAT and dist.get_rank() == 0:
                log.warning("sync %s: the saved state reduced in two levels; this topology has one: reducing flat",
                            self.name)
            return
        level = level or FLAT
        if level not in self.levels:
            raise ValueError(f"sync state has level {level!r}; known: {', '.join(self.levels)}")
        self.auto.level = level
        self._use_level()

    def _use_level(self) -> None:
        """Reduce on the level ``auto`` chose, from the next bucket on (where it chooses one)."""
        if self.levels is not None and self.auto is not None:
            self.reducer = self.levels[self.auto.level]

    def close(self) -> None:
        """Stop the ordering thread (if one was started); idempotent."""
        if self._queue is not None:
            self._queued_before += self._queue.jobs_submitted
            self._queue.close()
            self._queue = None

    # -- healing in place (slipstream.heal) -----------------------------------------------------
    def leave(self) -> None:
        """The default group failed and was destroyed: stop the ordering thread (a job still queued
        fails at once, without a collective) and let go of every group this engine holds, the
        cached ones of :func:`.topology.groups` included, so their sockets close and no peer waits
        on them. The groups are formed again in :meth:`rejoined`."""
        if self._broken is None:
            self._broken = RuntimeError(f"sync {self.name}: the process group was destroyed (healing in place)")
        self.close()
        if self._broken.__traceback__ is not None:  # its frames hold the broken group (dist.all_reduce's locals)
            traceback.clear_frames(self._broken.__traceback__)
        for reducer in self._reducers():
            reducer.let_go()
        self.control = ControlWire(None)
        if self.auto is not None:
            self.auto.control = self.control
        from .topology import forget

        forget()

    def rejoined(self, group: Any = None) -> None:
        """The default group was formed again (healing in place; a replacement's first real one):
        the topology's groups are built again, in the same order on every rank (a collective), and
        every reducer, the control wire and ``auto``'s policy move onto them. The strategy's state
        is then loaded from the snapshot (:meth:`load_state_dict`); what lives between a step's
        buckets is dropped here. ``group`` is for the :class:`SyncHandle` signature: the hook
        engine's groups follow the default group."""
        from .topology import forget, groups

        self.close()
        forget()
        g = groups()
        for reducer in self._reducers():
            reducer.regroup(g)
        self.control = ControlWire(g.control)
        if self.auto is not None:
            self.auto.control = self.control
        self._open = None
        self._broken = None
        self._passthrough = True  # until the next forward: the bucket-order fix's zeros stay local
        self._take_saved_link = True
        for codec in self.codecs.values():
            codec.reset_signal()  # the failed step's norms: a step boundary holds none (the guard reset them)

    def _reducers(self) -> list[Reducer]:
        """Every reducer this engine may use (one, or ``auto``'s two levels), each once."""
        out: list[Reducer] = [self.reducer]
        for r in (self.levels or {}).values():
            if not any(r is o for o in out):
                out.append(r)
        return out

    def fallback(self, reason: str) -> None:
        """Synchronise uncompressed from the next step on (call on every rank at the same step)."""
        self.mode = self.mode.to(Mode.FALLBACK)
        self.fallback_reason = reason
        if self.auto is not None:
            self.auto.stop_verifying()  # nothing left to verify: back to the direct path
        self._set_guard_state()
        if dist.get_rank() == 0:
            log.warning("sync %s: falling back to uncompressed all-reduce: %s", self.name, reason)

    def _probe_flat(self) -> Link:
        """The default prober: the reducer's data group, agreed on the control group."""
        group = self.reducer.wire.group if isinstance(self.reducer, FlatReducer) else None
        return probe_link(group, device=self.device, control=self.control)

    # -- which codec, which path -----------------------------------------------------------
    def _codec_name(self, index: int) -> str:
        if self.mode.uncompressed:
            return "allreduce"
        return self.decisions.get(index, self.default)

    def _names_in_use(self) -> set[str]:
        if self.mode.uncompressed:
            return {"allreduce"}
        return set(self.decisions.values()) if self.decisions else {self.default}

    def _compressing(self) -> bool:
        return any(n != "allreduce" for n in self._names_in_use())

    def _set_guard_state(self) -> None:
        if self.guard is not None:
            self.guard.compressing = self._compressing()

    def _guarded(self) -> bool:
        """Whether the guard checks the plan in use: only error-feedback codecs carry what it
        watches. A cast keeps nothing between steps and, like torch's bf16 hook and the plain
        ``bf16`` strategy, runs unguarded (and so on the direct path)."""
        return self.guard is not None and any(
            isinstance(self.codecs[n], ErrorFeedback) for n in self._names_in_use())

    def _direct(self) -> bool:
        """True when every bucket needs one stateless collective and the engine none of its own."""
        if self.mode is Mode.OBSERVE or self._probe_requested or not isinstance(self.reducer, FlatReducer):
            return False
        if self.auto is not None and self.auto.verifying:  # the engine needs its control step to verify
            return False
        # Only the codecs in use count: auto's plan of casts and all-reduce goes direct even
        # though its candidates include error-feedback codecs (and so it has a guard).
        return all(type(self.codecs[n]) in (Codec, Cast) for n in self._names_in_use())

    def _layout(self, bucket: dist.GradBucket, key: Hashable, numel: int) -> Layout | None:
        # Cached by the bucket's parameters: DDP's first iteration groups and orders
        # them differently from later ones, under the same bucket index.
        if key not in self._layouts:
            layout = layout_from_shapes([g.shape for g in bucket.gradients()])
            self._layouts[key] = layout if sum(p.numel for p in layout) == numel else None
        return self._layouts[key]

    # -- per bucket (hook thread) --------------------------------------------------------
    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        # The backward's stream reached this point: on GPUs an event, which the comm
        # thread's stream waits for before it touches the bucket.
        if self._passthrough:  # a backward without a forward after a heal: the bucket-order fix's zeros
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        now = self.clock.mark()
        if self._open is None:
            self._open = StepRecord(t_backward_start=self._t_forward_end)
            # Codecs compute the guard's norms only for the step it will check.
            check = self.guard is not None and (self.steps + 1) % self.guard.check_every_steps == 0
            for c in self.codecs.values():
                if isinstance(c, ErrorFeedback):
                    c.track_signal = check
        step = self._open
        index, buf, last = bucket.index(), bucket.buffer(), bucket.is_last()
        step.ready[index] = now
        step.numel[index] = buf.numel()
        step.itemsize[index] = buf.element_size()
        if last:
            step.t_last_ready = now
            self._open = None
        name = self._codec_name(index)
        # The level is fixed for the step: it changes only in the control step after the last bucket.
        reducer = self.reducer
        step.uncompressed_bytes += reducer.uncompressed_bytes(buf.numel(), buf.element_size())
        if self._direct():
            if self._queue is not None:  # idle since the last step (DDP waited for its jobs): stop it
                self.close()
            return self._direct_reduce(buf, self.codecs[name], step, last)
        # Codec state follows the parameters, not DDP's bucket numbering (which a
        # rebuild or a resumed run may change): key = the bucket's parameter indices.
        key = tuple(self._param_index.get(id(p), -1) for p in bucket.parameters())
        layout = self._layout(bucket, key, buf.numel())
        step.keys[index] = key
        if self._queue is None:
            self._queue = OrderedQueue(device=buf.device)
        return self._queue.submit(lambda: self._job(reducer, index, key, buf, name, layout, step, last, now))

    def _direct_reduce(self, buf: torch.Tensor, codec: Codec, step: StepRecord, last: bool) -> torch.futures.Future:
        assert isinstance(self.reducer, FlatReducer)
        wire = self.reducer.wire
        n = wire.size
        payload = codec.encode(buf, n) if isinstance(codec, Cast) else buf
        t0 = self.clock.mark()
        nbytes = allreduce_bytes(payload.numel() * payload.element_size(), n)
        with self._lock:
            wire.bytes_sent += nbytes
            step.bytes_sent += nbytes
            step.pending += 1
            step.last_seen = step.last_seen or last
        fut = dist.all_reduce(payload, group=wire.group, async_op=True).get_future()

        def done(f: torch.futures.Future) -> torch.Tensor:
            out = f.value()[0]
            result = codec.decode(out, buf, n) if isinstance(codec, Cast) else out.div_(n)
            # On GPUs this callback runs at enqueue, on a stream that waits for the
            # collective: the mark's event completes when the collective has.
            t1 = self.clock.mark()
            with self._lock:
                step.comm_spans.append((t0, t1))
                step.pending -= 1
                if step.pending == 0 and step.last_seen:  # the last of the step's collectives
                    self._finish(step, t1)
            return result

        return fut.then(done)

    # -- per bucket (comm thread) ----------------------------------------------------------
    def _job(self, reducer: Reducer, index: int, key: Hashable, buf: torch.Tensor, name: str, layout: Layout | None,
             step: StepRecord, last: bool, ready: Mark):
        if ready[1] is not None:  # the gradients the backward stream wrote, on this thread's stream
            stream = torch.cuda.current_stream()
            stream.wait_event(ready[1])
            if self._loaded:
                # State loaded at resume was allocated on the default stream and is read,
                # overwritten and dropped here: recorded, the caching allocator keeps each
                # block from the backward until this stream's work on it is done. (Its
                # first write happened before the backward's ready event: the wait covers it.)
                for t in self._loaded:
                    t.record_stream(stream)
        self._loaded = []
        if self._broken is not None:  # an earlier bucket's collective failed (healing in place): that error
            raise self._broken
        try:
            return self._reduce_job(reducer, index, key, buf, name, layout, step, last)
        except Exception as exc:
            self._broken = exc  # the step's later jobs fail with it at once: nothing more on the broken groups
            raise

    def _reduce_job(self, reducer: Reducer, index: int, key: Hashable, buf: torch.Tensor, name: str,
                    layout: Layout | None, step: StepRecord, last: bool) -> torch.Tensor:
        t0 = self.clock.mark()
        before = reducer.bytes_sent
        inter = reducer.inter if isinstance(reducer, Hierarchical) else None
        inter_before = inter.bytes_sent if inter is not None else 0.0
        codec = self.codecs[name]
        scale = self._loss_scale() if self._loss_scale is not None and isinstance(codec, ErrorFeedback) else None
        if scale is not None:  # true-gradient units for the residual (use_loss_scale); inf/NaN stay so
            buf.div_(scale)
        out = reducer.reduce(buf, codec, key, layout)
        if scale is not None:
            out.mul_(scale)
        if self.mode is Mode.OBSERVE and self.auto is not None:
            step.outputs[index] = out  # auto measures its codecs on this gradient (a reference)
        step.bytes_sent += reducer.bytes_sent - before
        if inter is not None:
            step.inter_node_bytes = (step.inter_node_bytes or 0.0) + inter.bytes_sent - inter_before
        t1 = self.clock.mark()
        step.comm_spans.append((t0, t1))
        if last:
            self._finish(step, t1)
            self._control()  # collectives of the engine, after the last bucket, same order everywhere
        return out

    def _finish(self, step: StepRecord, done: Mark) -> None:
        self.ledger.finish(step, done)
        if self.mode is Mode.WARMUP and self.steps >= self.options.warmup_steps:
            # Same step count on every rank, so every rank switches at the same step.
            self.mode = self.mode.to(Mode.RUN)
            self._set_guard_state()

    def _control(self) -> None:
        """The engine's own collectives, on the comm thread after a step's last bucket."""
        last = self.ledger.last
        assert last is not None
        if self._probe_requested:
            self._probe_requested = False
            link = self._prober()
            log.info("sync: re-probed link: %s", link.summary())
            if self.auto is not None:
                self.auto.link = link
                if self.mode is not Mode.FALLBACK:
                    self.mode = self.mode.to(Mode.OBSERVE) if self.mode is not Mode.OBSERVE else self.mode
                    self.auto.reset()  # observes again on flat
                    self._use_level()
                    self._set_guard_state()
            return
        if self.auto is not None and self.mode is Mode.OBSERVE:
            if self.auto.observe(last, self.steps, self.clock, self.device, self._layouts, self.codecs):
                self.mode = self.mode.to(Mode.RUN)
                self._use_level()  # the level it chose, from the next step
                self._set_guard_state()
            return
        if self.auto is not None and self.mode is Mode.RUN and self.auto.verifying:
            if self.auto.verify(last, self.clock):  # reverted: flat all-reduce, what was observed
                self._use_level()
                self._set_guard_state()
        if self._guarded() and self.steps % self.guard.check_every_steps == 0:
            reason = self.guard.check(self.control, self.codecs.values())
            if reason is not None and not self._retreat_to_flat(reason):
                self.fallback(reason)

    def _retreat_to_flat(self, reason: str) -> bool:
        """``auto`` on the hierarchical level: the guard's trip moves it to its flat plan, once
        (:meth:`.auto.AutoPolicy.retreat_to_flat`); False where that does not apply. The
        residuals the hierarchical plan carried are dropped, as a fallback drops them."""
        if self.auto is None or self.levels is None or not self.auto.retreat_to_flat(reason):
            return False
        for codec in self.codecs.values():
            if isinstance(codec, ErrorFeedback):
                codec.forget_residuals()
        self._use_level()
        self._set_guard_state()
        if dist.get_rank() == 0:
            log.warning("sync %s: %s", self.name, self.auto.verification)
        return True


def _to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` (dicts, lists, tuples of tensors and plain values) with every tensor on ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_to_device(v, device) for v in tree)
    return tree


def _hook(state: HookSync, bucket: dist.GradBucket) -> torch.futures.Future:
    return state.on_bucket(bucket)


# DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
