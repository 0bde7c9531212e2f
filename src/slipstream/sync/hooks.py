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
and its transitions), :mod:`.codec_plan` (which codec each bucket goes through),
:mod:`.engine_groups` (the groups held, and healing's let-go and re-forming),
:mod:`.hook_state` (the checkpoint format), :mod:`.auto` (``auto``'s
observe/decide/verify loop over :mod:`.policy`), :mod:`.probe` (link
measurements), :mod:`.options` (every setting and its default).

On GPUs the comm thread only *enqueues* on its own CUDA stream, after waiting
on the device for the event the backward recorded when the bucket became ready;
every time ``auto`` and the stats use comes from CUDA events
(:mod:`slipstream.process.timing`), read back only where the host waits anyway.
Agreements between ranks go on the gloo control group
(:class:`~.control.ControlWire`), data on the data groups (rule: :mod:`.topology`).

Example::

    state = HookSync("powersgd", FlatReducer(groups().flat), {"powersgd": PowerSGD(rank=4)}, "powersgd")
    state.install(ddp_model)
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..network.link import Link
from ..process.timing import HostClock, Mark, clock_for
from . import hook_state
from .accounting import Ledger, StepRecord
from .auto import AutoPolicy
from .codec_plan import CodecPlan
from .compress.base import Codec, ErrorFeedback, Layout, layout_from_shapes
from .control import ControlWire
from .direct import DirectPath
from .engine_groups import EngineGroups, Reducer
from .guard import ConvergenceGuard
from .hierarchical import FlatReducer, Hierarchical
from .modes import Mode
from .options import SyncOptions
from .ordering import OrderedQueue
from .policy import Decision, FlatCost, HierarchicalCost

log = logging.getLogger("slipstream.sync")

LinkModel = Link | FlatCost | HierarchicalCost


class HookSync:
    """The hook engine's state (see the module docstring); implements :class:`~slipstream.sync.SyncHandle`.

    reducer, control_group, levels: the groups held (:class:`~.engine_groups.EngineGroups`); with
      ``levels`` the engine reduces flat until ``auto``'s decision, then on the level it chose.
    codecs, default: which codec each bucket goes through (:class:`~.codec_plan.CodecPlan`).
    options: the settings (:class:`~.options.SyncOptions`): ``warmup_steps``, and
      for ``auto`` (``auto=True``) its observation window, candidates, verification.
    guard: convergence guard, checked while an error-feedback codec compresses.
    link: the start-up probe's figures (``auto``); prober: measures the link(s) again,
      collective on every rank, called from the comm thread.
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
        self.options = options if options is not None else SyncOptions()
        # Host-side agreements (guard votes, auto's figures): the gloo control group.
        if control_group is None and dist.is_initialized():
            from .topology import groups

            control_group = groups().control
        # The groups held (reducers, control wire): a collaborator, so healing lets go of them all.
        self.groups = EngineGroups(reducer, ControlWire(control_group), levels, auto)
        self.guard = guard
        self._prober = prober if prober is not None else self._probe_flat
        self.world_size = self.control.size
        self.auto = (AutoPolicy(self.options, self.control, self.world_size, link, self._prober, name,
                                local_rank=self.groups.local_rank) if auto else None)
        # Which codec each bucket goes through (default, auto's choices, the mode): a collaborator.
        self.plan = CodecPlan(codecs, default, Mode.initial(auto, self.options.warmup_steps), self.auto, guard)
        # Where the gradients live (set by install): data collectives and clocks follow it.
        self.device = torch.device("cpu")
        self.clock: Any = HostClock()
        self.ledger = Ledger()
        self._open: StepRecord | None = None
        self._layouts: dict[Hashable, Layout | None] = {}
        self._probe_requested = False
        self._t_forward_end: Mark | None = None
        self._direct_path = DirectPath()  # the direct path's sends (its lock guards the step's counters)
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
        self.plan.update_guard()

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
        return self.plan.decisions

    # The collaborators' state, read (and the mode set) under the names it always had.
    reducer = property(lambda self: self.groups.reducer, doc="The reducer in use (:class:`.EngineGroups`).")
    levels = property(lambda self: self.groups.levels, doc="``auto``'s reducer of each level, or None.")
    control = property(lambda self: self.groups.control, doc="The control group's wire.")
    codecs = property(lambda self: self.plan.codecs, doc="Codec objects by name (:class:`.CodecPlan`).")
    default = property(lambda self: self.plan.default, doc="Every bucket's codec until ``auto`` decides.")
    fallback_reason = property(lambda self: self.plan.fallback_reason, doc="Why compression stopped, or None.")
    mode = property(lambda self: self.plan.mode, lambda self, m: setattr(self.plan, "mode", m),
                    doc="The engine's :class:`~.modes.Mode`.")

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
        """Per-step accounting for the metrics recorder (last synchronising step; :mod:`.hook_state`)."""
        return hook_state.figures(self)

    @property
    def level(self) -> str:
        """How buckets are reduced now: ``"flat"`` (one group of all ranks) or ``"hierarchical"``."""
        return self.groups.level

    def decision_summary(self) -> str:
        """The codecs in use, counted over buckets: ``"allreduce:3,powersgd:2"``; where ``auto``
        chooses the level too, the level follows: ``"allreduce:3,powersgd:2 on hierarchical"``."""
        return self.plan.summary(self.level if self.levels is not None else None)

    def state_dict(self) -> dict[str, Any]:
        """Per-rank checkpoint state (the format: :mod:`.hook_state`)."""
        return hook_state.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = hook_state.load_state_dict(self, state, take_saved_link=self._take_saved_link)
        self._take_saved_link = False

    def _use_level(self) -> None:
        """Reduce on the level ``auto`` chose, from the next bucket on (where it chooses one)."""
        if self.auto is not None:
            self.groups.use(self.auto.level)

    def close(self) -> None:
        """Stop the ordering thread (if one was started); idempotent."""
        if self._queue is not None:
            self._queued_before += self._queue.jobs_submitted
            self._queue.close()
            self._queue = None

    # -- healing in place (slipstream.resilience.heal) -----------------------------------------------------
    def leave(self) -> None:
        """The default group failed and was destroyed: stop the ordering thread (a job still queued
        fails at once, without a collective) and let go of every group this engine holds
        (:meth:`.EngineGroups.leave`), so their sockets close and no peer waits on them. The
        groups are formed again in :meth:`rejoined`."""
        if self._broken is None:
            self._broken = RuntimeError(f"sync {self.name}: the process group was destroyed (healing in place)")
        self.close()
        if self._broken.__traceback__ is not None:  # its frames hold the broken group (dist.all_reduce's locals)
            traceback.clear_frames(self._broken.__traceback__)
        self.groups.leave()
        if self.auto is not None:
            self.auto.control = self.control

    def rejoined(self, group: Any = None) -> None:
        """The default group was formed again (healing in place; a replacement's first real one):
        the topology's groups are built again, in the same order on every rank (a collective), and
        every reducer, the control wire and ``auto``'s policy move onto them. The strategy's state
        is then loaded from the snapshot (:meth:`load_state_dict`); what lives between a step's
        buckets is dropped here. ``group`` is for the :class:`SyncHandle` signature: the hook
        engine's groups follow the default group."""
        self.close()
        self.groups.rejoin()
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
        return self.groups.reducers()

    def fallback(self, reason: str) -> None:
        """Synchronise uncompressed from the next step on (call on every rank at the same step)."""
        self.plan.fall_back(reason)
        if dist.get_rank() == 0:
            log.warning("sync %s: falling back to uncompressed all-reduce: %s", self.name, reason)

    def _probe_flat(self) -> Link:
        """The default prober: the reducer's data group, agreed on the control group."""
        return self.groups.probe_flat(self.device)

    # -- which path ------------------------------------------------------------------------
    def _direct(self) -> bool:
        """True when every bucket needs one stateless collective and the engine none of its own."""
        if self.mode is Mode.OBSERVE or self._probe_requested or not isinstance(self.reducer, FlatReducer):
            return False
        if self.auto is not None and self.auto.verifying:  # the engine needs its control step to verify
            return False
        return self.plan.stateless()

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
        name = self.plan.codec_name(index)
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
        return self._direct_path.reduce(self.reducer.wire, buf, codec, step, last, self.clock, self._finish)

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
            self.plan.update_guard()

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
                    self.plan.update_guard()
            return
        if self.auto is not None and self.mode is Mode.OBSERVE:
            if self.auto.observe(last, self.steps, self.clock, self.device, self._layouts, self.codecs):
                self.mode = self.mode.to(Mode.RUN)
                self._use_level()  # the level it chose, from the next step
                self.plan.update_guard()
            return
        if self.auto is not None and self.mode is Mode.RUN and self.auto.verifying:
            if self.auto.verify(last, self.clock):  # reverted: flat all-reduce, what was observed
                self._use_level()
                self.plan.update_guard()
        if self.plan.guarded() and self.steps % self.guard.check_every_steps == 0:
            reason = self.guard.check(self.control, self.codecs.values())
            if reason is not None and not self._retreat_to_flat(reason):
                self.fallback(reason)

    def _retreat_to_flat(self, reason: str) -> bool:
        """``auto`` on the hierarchical level: the guard's trip moves it to its flat plan, once
        (:meth:`.auto.AutoPolicy.retreat_to_flat`); False where that does not apply. The
        residuals the hierarchical plan carried are dropped, as a fallback drops them."""
        if self.auto is None or self.levels is None or not self.auto.retreat_to_flat(reason):
            return False
        self.plan.forget_residuals()
        self._use_level()
        self.plan.update_guard()
        if dist.get_rank() == 0:
            log.warning("sync %s: %s", self.name, self.auto.verification)
        return True


def _hook(state: HookSync, bucket: dist.GradBucket) -> torch.futures.Future:
    return state.on_bucket(bucket)


# DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
_hook.__annotations__ = {"state": object, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
