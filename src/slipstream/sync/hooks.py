"""The sync engine: strategies as DDP comm hooks that keep one global collective order.

DDP hands buckets to a comm hook in bucket order, the same on every rank. The
danger is work that launches a *second* collective for a bucket from a
``fut.then()`` callback: callbacks run when a collective completes, and
completion order differs between ranks, so ranks can post collectives in
different orders and gloo fails ("Received data size doesn't match expected
size", as torch's powerSGD_hook does with several buckets). Here every
collective is launched either

* from the hook itself, for strategies with one collective per bucket (fp32,
  bf16, fp16: the "direct" path; callbacks only decode locally), or
* from one comm thread per model that runs the buckets' jobs first-in,
  first-out (:class:`OrderedQueue`): multi-collective codecs (PowerSGD, top-k,
  sign), hierarchical reduction, and the engine's own control collectives
  (guard checks, policy agreement) all go through it, so they reach every rank
  in the same order while backward carries on computing the next buckets.

On GPUs the comm thread only *enqueues*: it runs each job on its own CUDA
stream, after waiting (on the device) for the event the backward recorded when
the bucket became ready, and hands DDP a CUDA-aware future whose completion
makes DDP's stream wait for that stream's work: no host synchronisation per
bucket, and the buckets' kernels and collectives queue up behind each other
while backward computes. Every time ``auto`` and the stats use comes from CUDA
events (:mod:`slipstream.timing`), read back only where the host waits anyway:
a log step (``stats()``), or the few steps where ``auto`` observes and
verifies. Agreements between ranks go on the gloo control group
(:class:`~.control.ControlWire`), data on the data groups (rule: :mod:`.topology`).

:class:`HookSync` is the state object ``sync.apply`` returns: ``stats()`` for
the metrics recorder, ``state_dict()/load_state_dict()`` for checkpoints,
``observe_loss()`` for the convergence guard, ``request_probe()`` to re-measure.

Example::

    state = HookSync("powersgd", FlatReducer(groups().flat), {"powersgd": PowerSGD(rank=4)}, "powersgd")
    state.install(ddp_model)
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..timing import HostClock, Mark, clock_for, duration_s
from .compress.base import Codec, Layout, Wire, layout_from_shapes
from .compress.cast import Cast
from .control import ControlWire
from .guard import ConvergenceGuard
from ..link import allreduce_bytes
from .policy import BucketInfo, Decision, as_cost, decide, verify_plan
from .probe import probe_link

log = logging.getLogger("slipstream.sync")


class OrderedQueue:
    """One daemon thread running submitted jobs first-in, first-out.

    ``submit(fn)`` returns a ``torch.futures.Future`` completed with ``fn()``'s
    result (or its exception). Jobs run one at a time, so collectives they
    launch keep submission order.

    ``device`` CUDA: the thread makes it its current device before anything
    else (otherwise its first CUDA call creates a context on GPU 0, on every
    rank), runs every job on one side stream, and completes each future while
    that stream is current. The futures are CUDA-aware (``devices=[device]``):
    completing one records an event on the side stream, and whoever waits on
    it (DDP) has its current stream wait for that event on the device, not on
    the host.
    """

    def __init__(self, name: str = "slipstream-sync", device: torch.device | None = None):
        self.device = device if device is not None and device.type == "cuda" else None
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> torch.futures.Future:
        fut: torch.futures.Future = (
            torch.futures.Future(devices=[self.device]) if self.device is not None else torch.futures.Future()
        )
        self._q.put((fn, fut))
        return fut

    def _run(self) -> None:
        stream = None
        if self.device is not None:
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(device=self.device)
        while True:
            fn, fut = self._q.get()
            if fn is None:
                return
            if stream is None:
                self._complete(fn, fut)
                continue
            with torch.cuda.stream(stream):
                self._complete(fn, fut)

    @staticmethod
    def _complete(fn: Callable[[], Any], fut: torch.futures.Future) -> None:
        try:
            result = fn()
        except BaseException as exc:  # delivered to DDP's wait(), which raises it
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def close(self) -> None:
        self._q.put((None, None))
        # Joined so no collective of this thread is alive when the process
        # group is destroyed (a C++ worker torn down mid-use aborts the process).
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)


@dataclass
class _Step:
    """Accounting of one synchronising backward.

    Times are marks (:mod:`slipstream.timing`): CUDA events on GPUs, host
    clock readings on CPU. :meth:`resolve` turns them into seconds once,
    waiting for the events; only ``stats()`` (log steps) and ``auto``'s
    observe/verify steps call it.
    """

    t_backward_start: Mark | None
    ready: dict[int, Mark] = field(default_factory=dict)
    numel: dict[int, int] = field(default_factory=dict)
    keys: dict[int, Hashable] = field(default_factory=dict)
    bytes_sent: float = 0.0
    uncompressed_bytes: float = 0.0
    inter_node_bytes: float | None = None  # hierarchical only: the part on the slow links
    pending: int = 0  # direct path: collectives launched and not yet completed
    last_seen: bool = False
    comm_spans: list[tuple[Mark, Mark]] = field(default_factory=list)
    t_last_ready: Mark | None = None
    t_done: Mark | None = None
    # Filled by resolve():
    ready_s: dict[int, float] = field(default_factory=dict)  # since t_backward_start
    comm_s: float = 0.0
    exposed_s: float = 0.0  # last bucket ready -> last collective done
    span_s: float = 0.0  # backward start -> last collective done
    resolved: bool = False

    def resolve(self, clock: Any) -> _Step:
        if self.resolved or self.t_done is None:
            return self
        marks = [self.t_backward_start, self.t_last_ready, self.t_done, *self.ready.values()]
        marks += [m for span in self.comm_spans for m in span]
        clock.synchronize(marks, streams="many")
        start = self.t_backward_start
        if start is not None:
            self.ready_s = {i: duration_s(start, m) for i, m in self.ready.items()}
            self.span_s = duration_s(start, self.t_done)
        self.comm_s = sum(duration_s(a, b) for a, b in self.comm_spans)
        if self.t_last_ready is not None:
            self.exposed_s = duration_s(self.t_last_ready, self.t_done)
        self.resolved = True
        return self


class HookSync:
    """State of a hook-based strategy (see module docstring).

    reducer: FlatReducer or Hierarchical (how a codec's collectives are laid out).
    codecs: codec objects by name; ``default`` is used for every bucket until a
      policy decides otherwise. ``"allreduce"`` is added if missing (fallback).
    policy: for ``auto``, observe ``observe_steps`` steps uncompressed, then decide.
    guard: convergence guard, checked while any bucket is compressed.
    """

    def __init__(
        self,
        name: str,
        reducer: Any,
        codecs: dict[str, Codec],
        default: str,
        control_group: Any = None,
        guard: ConvergenceGuard | None = None,
        policy: dict[str, Any] | None = None,
        link: Any = None,
        warmup_steps: int = 0,
        prober: Any = None,
    ):
        self.name = name
        self.reducer = reducer
        self.codecs = dict(codecs)
        self.codecs.setdefault("allreduce", Codec())
        if default not in self.codecs:
            raise KeyError(f"default codec {default!r} not in {sorted(self.codecs)}")
        self.default = default
        # Host-side agreements (guard votes, auto's figures): the gloo control group.
        if control_group is None and dist.is_initialized():
            from .topology import groups

            control_group = groups().control
        self.control = ControlWire(control_group)
        self.guard = guard
        self.policy = policy  # None, or options of policy.decide plus observe_steps
        self.link = link  # a measured Link, or a cost object of .policy (hierarchical+auto)
        # Measures the link(s) again; collective on every rank, from the comm thread after start.
        self._prober = prober if prober is not None else self._probe_flat
        self.world_size = self.control.size
        # Where the gradients live (set by install): data collectives and clocks follow it.
        self.device = torch.device("cpu")
        self.clock: Any = HostClock()
        self.decisions: dict[int, str] = {}
        self.decision: Decision | None = None
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        # observe (auto), warmup (uncompressed first steps), run, fallback.
        self.mode = "observe" if policy is not None else ("warmup" if warmup_steps else "run")
        self.fallback_reason: str | None = None
        self.steps = 0
        self.bytes_sent_total = 0.0
        self.uncompressed_bytes_total = 0.0
        self.last: _Step | None = None
        self._open: _Step | None = None
        self._layouts: dict[Hashable, Layout | None] = {}
        self._observed: list[_Step] = []
        # auto: after a decision that compresses, time a few steps under it and compare.
        self._verify_baseline_s: float | None = None
        self._verify_samples: list[_Step] = []
        self.verification: str | None = None
        self._probe_requested = False
        self._t_forward_end: Mark | None = None
        self._lock = threading.Lock()
        self._param_index: dict[int, int] = {}
        self._queue: OrderedQueue | None = None
        if guard is not None:
            guard.compressing = self._compressing()

    # -- installation ------------------------------------------------------------------
    def install(self, ddp: DistributedDataParallel) -> HookSync:
        def on_forward(module: Any, args: Any, output: Any) -> None:
            self._t_forward_end = self.clock.mark()

        params = list(ddp.module.parameters())
        if params:
            self.device = params[0].device
        self.clock = clock_for(self.device)
        self._param_index = {id(p): i for i, p in enumerate(params)}
        ddp.module.register_forward_hook(on_forward)
        ddp.register_comm_hook(self, _hook)
        return self

    # -- public API ----------------------------------------------------------------------
    def observe_loss(self, loss: float | torch.Tensor) -> None:
        """Feed this step's loss to the convergence guard (optional; a tensor stays on its
        device until the next check). Call it after backward."""
        if self.guard is not None and self.mode != "fallback":
            self.guard.observe_loss(loss)

    def request_probe(self) -> None:
        """Re-measure the link (and, for auto, re-observe and re-decide) at the next step.

        Call it on every rank at the same step."""
        self._probe_requested = True

    def stats(self) -> dict[str, Any]:
        """Per-step accounting for the metrics recorder (last synchronising step)."""
        last = self.last
        out: dict[str, Any] = {
            "sync_strategy": self.name,
            "sync_mode": self.mode,
            "sync_steps": self.steps,
            "sync_bytes_sent_total": self.bytes_sent_total,
        }
        if last is not None:
            last.resolve(self.clock)  # log steps only: waits for the step's events
            out["sync_bytes_sent"] = last.bytes_sent
            out["sync_uncompressed_bytes"] = last.uncompressed_bytes
            out["sync_compression_ratio"] = last.uncompressed_bytes / last.bytes_sent if last.bytes_sent else 1.0
            out["sync_exposed_comm_s"] = last.exposed_s
            out["sync_comm_s"] = last.comm_s
            if last.inter_node_bytes is not None:
                out["sync_inter_node_bytes_sent"] = last.inter_node_bytes
        out["sync_decision"] = self.decision_summary()
        if self.verification:
            out["sync_verification"] = self.verification
        if self.fallback_reason:
            out["sync_fallback_reason"] = self.fallback_reason
        if self.guard is not None and self.guard.last_error_ratio is not None:
            out["sync_error_ratio"] = self.guard.last_error_ratio
        return out

    def decision_summary(self) -> str:
        if not self.decisions:
            return self.default if self.mode != "observe" else "allreduce (observing)"
        counts: dict[str, int] = {}
        for v in self.decisions.values():
            counts[v] = counts.get(v, 0) + 1
        return ",".join(f"{k}:{v}" for k, v in sorted(counts.items()))

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "steps": self.steps,
            "mode": self.mode,
            "default": self.default,
            "decisions": dict(self.decisions),
            "fallback_reason": self.fallback_reason,
            "verification": self.verification,
            "bytes_sent_total": self.bytes_sent_total,
            "codecs": {k: c.state_dict() for k, c in self.codecs.items()},
            "guard": self.guard.state_dict() if self.guard is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"sync state is for strategy {state.get('name')!r}, this run uses {self.name!r}")
        self.steps = int(state["steps"])
        self.mode = state["mode"]
        self.default = state["default"]
        self.decisions = {int(k): v for k, v in state["decisions"].items()}
        self.fallback_reason = state.get("fallback_reason")
        self.verification = state.get("verification")
        self.bytes_sent_total = float(state.get("bytes_sent_total", 0.0))
        for k, sd in state["codecs"].items():
            if k in self.codecs:
                # Residuals and Q factors live where the gradients do: a checkpoint
                # written on another device (or loaded to the CPU) is moved here once.
                self.codecs[k].load_state_dict(_to_device(sd, self.device))
        if self.guard is not None and state.get("guard") is not None:
            self.guard.load_state_dict(state["guard"])

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None

    def _probe_flat(self) -> Any:
        """The default prober: the reducer's data group, agreed on the control group."""
        return probe_link(getattr(self.reducer, "wire", Wire(None)).group, device=self.device, control=self.control)

    # -- per bucket (hook thread) --------------------------------------------------------
    def _codec_name(self, index: int) -> str:
        if self.mode in ("observe", "warmup", "fallback"):
            return "allreduce"
        return self.decisions.get(index, self.default)

    def _compressing(self) -> bool:
        if self.mode != "run":
            return False
        names = set(self.decisions.values()) if self.decisions else {self.default}
        return any(n != "allreduce" for n in names)

    def _direct(self) -> bool:
        """True when every bucket needs one collective and the engine none of its own."""
        if self.mode == "observe" or self._probe_requested or not hasattr(self.reducer, "wire"):
            return False
        if self._verify_baseline_s is not None:  # the engine needs its control step to verify
            return False
        if self.guard is not None and self._compressing() and any(
            c.error_feedback for c in self.codecs.values()
        ):
            return False
        names = set(self.decisions.values()) if self.decisions and self.mode == "run" else {self._codec_name(-1)}
        return all(type(self.codecs[n]) in (Codec, Cast) for n in names)

    def _layout(self, bucket: dist.GradBucket, key: Hashable, numel: int) -> Layout | None:
        # Cached by the bucket's parameters: DDP's first iteration groups and orders
        # them differently from later ones, under the same bucket index.
        if key not in self._layouts:
            layout = layout_from_shapes([g.shape for g in bucket.gradients()])
            self._layouts[key] = layout if sum(p.numel for p in layout) == numel else None
        return self._layouts[key]

    def on_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        # The backward's stream reached this point: on GPUs an event, which the comm
        # thread's stream waits for before it touches the bucket.
        now = self.clock.mark()
        if self._open is None:
            self._open = _Step(t_backward_start=self._t_forward_end)
            # Codecs compute the guard's norms only for the step it will check.
            check = self.guard is not None and (self.steps + 1) % self.guard.check_every_steps == 0
            for c in self.codecs.values():
                if hasattr(c, "track_signal"):
                    c.track_signal = check
        step = self._open
        index, buf, last = bucket.index(), bucket.buffer(), bucket.is_last()
        step.ready[index] = now
        step.numel[index] = buf.numel()
        if last:
            step.t_last_ready = now
            self._open = None
        name = self._codec_name(index)
        step.uncompressed_bytes += self.reducer.uncompressed_bytes(buf.numel(), 4)
        if self._direct():
            return self._direct_reduce(buf, self.codecs[name], step, last)
        # Codec state follows the parameters, not DDP's bucket numbering (which a
        # rebuild or a resumed run may change): key = the bucket's parameter indices.
        key = tuple(self._param_index.get(id(p), -1) for p in bucket.parameters())
        layout = self._layout(bucket, key, buf.numel())
        step.keys[index] = key
        if self._queue is None:
            self._queue = OrderedQueue(device=buf.device)
        return self._queue.submit(lambda: self._job(index, key, buf, name, layout, step, last, now))

    def _direct_reduce(self, buf: torch.Tensor, codec: Codec, step: _Step, last: bool) -> torch.futures.Future:
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
                step.t_done = t1
                step.pending -= 1
                if step.pending == 0 and step.last_seen:  # the last of the step's collectives
                    self._finish(step, t1)
            return result

        return fut.then(done)

    # -- per bucket (comm thread) ----------------------------------------------------------
    def _job(self, index: int, key: Hashable, buf: torch.Tensor, name: str, layout: Layout | None, step: _Step,
             last: bool, ready: Mark):
        if ready[1] is not None:  # the gradients the backward stream wrote, on this thread's stream
            torch.cuda.current_stream().wait_event(ready[1])
        t0 = self.clock.mark()
        before = self.reducer.bytes_sent
        inter = getattr(self.reducer, "inter", None)
        inter_before = inter.bytes_sent if inter is not None else 0.0
        out = self.reducer.reduce(buf, self.codecs[name], key, layout)
        step.bytes_sent += self.reducer.bytes_sent - before
        if inter is not None:
            step.inter_node_bytes = (step.inter_node_bytes or 0.0) + inter.bytes_sent - inter_before
        t1 = self.clock.mark()
        step.comm_spans.append((t0, t1))
        if last:
            self._finish(step, t1)
            self._control()  # collectives of the engine, after the last bucket, same order everywhere
        return out

    def _finish(self, step: _Step, done: Mark) -> None:
        step.t_done = done
        self.steps += 1
        if self.mode == "warmup" and self.steps >= self.warmup_steps:
            # Same step count on every rank, so every rank switches at the same step.
            self.mode = "run"
            if self.guard is not None:
                self.guard.compressing = self._compressing()
        self.bytes_sent_total += step.bytes_sent
        self.uncompressed_bytes_total += step.uncompressed_bytes
        self.last = step

    def _control(self) -> None:
        if self._probe_requested:
            self._probe_requested = False
            self.link = self._prober()
            log.info("sync: re-probed link: %s", self.link.summary())
            if self.policy is not None and self.mode != "fallback":
                self.mode, self.decisions, self._observed = "observe", {}, []
                self._verify_baseline_s, self.verification = None, None
                if self.guard is not None:
                    self.guard.compressing = False
            return
        if self.mode == "observe":
            self._observe(self.last)
            return
        if self.mode == "run" and self._verify_baseline_s is not None:
            self._verify(self.last)
        if self.guard is not None and self._compressing() and self.steps % self.guard.check_every_steps == 0:
            reason = self.guard.check(self.control, self.codecs.values())
            if reason is not None:
                self.fallback(reason)

    def fallback(self, reason: str) -> None:
        """Synchronise uncompressed from the next step on (call on every rank at the same step)."""
        self.mode = "fallback"
        self.fallback_reason = reason
        self._verify_baseline_s = None  # nothing left to verify: back to the direct path
        if self.guard is not None:
            self.guard.compressing = False
        if dist.get_rank() == 0:
            log.warning("sync %s: falling back to uncompressed all-reduce: %s", self.name, reason)

    # -- auto: observe, measure, decide (comm thread) -------------------------------------
    def _observe(self, step: _Step) -> None:
        assert self.policy is not None
        # The first step runs with DDP's initial bucket order; it rebuilds buckets after it.
        if self.steps > 1 and step.t_backward_start is not None:
            self._observed.append(step)
        if len(self._observed) < self.policy.get("observe_steps", 3):
            return
        # Device times of the observed steps: this waits for their events, on the few
        # observe steps only (the decision needs them; steady state never waits).
        for s in self._observed:
            s.resolve(self.clock)
        last = self._observed[-1]
        order = sorted(last.ready_s, key=lambda i: last.ready_s[i])
        # Per bucket, the earliest ready time seen: the least disturbed by other processes.
        ready = [min(s.ready_s[i] for s in self._observed if i in s.ready_s) for i in order]
        if self.link is None:
            self.link = self._prober()
        costs = self._measure_costs(order, last)
        names = list(self.policy["candidates"])
        # Every rank decides from the same figures, agreed in one collective: ready times
        # MAX (the slowest rank's backward sets the step), codec costs MIN (negated under
        # MAX): the ranks run the same code on the same sizes, so the lower figure is the
        # one a transient burst of other load on one rank did not inflate.
        vals = self.control.agree(ready + [-costs[(i, nm)] for i in order for nm in names], op=dist.ReduceOp.MAX)
        ready, flat_costs = vals[: len(order)], [-v for v in vals[len(order) :]]
        agreed = {(i, nm): flat_costs[k * len(names) + j] for k, i in enumerate(order) for j, nm in enumerate(names)}
        buckets = [
            BucketInfo(i, last.numel[i], r, self._layouts.get(last.keys.get(i))) for i, r in zip(order, ready)
        ]
        self.decision = decide(
            buckets, self.link, self.world_size, agreed, {nm: self.codecs[nm] for nm in names},
            hidden_tolerance=self.policy.get("hidden_tolerance", 0.05),
        )
        self.decisions = dict(self.decision.choices)
        self.mode = "run"
        if self.guard is not None:
            self.guard.compressing = self._compressing()
        if self._compressing() and self.policy.get("verify_steps", 5) > 0:
            spans = sorted(s.span_s for s in self._observed)
            self._verify_baseline_s = spans[len(spans) // 2]
            self._verify_samples = []
        if dist.get_rank() == 0:
            log.info("%s", self.decision.explain())

    def _verify(self, step: _Step) -> None:
        """Time ``verify_steps`` steps under the plan (after one to warm up); revert to
        all-reduce if they are not faster than the uncompressed steps observed before."""
        assert self.policy is not None
        self._verify_samples.append(step)
        if len(self._verify_samples) < 1 + self.policy.get("verify_steps", 5):
            return
        # Read the device times once, when all the verify steps are in.
        spans = sorted(s.resolve(self.clock).span_s for s in self._verify_samples[1:])
        # The slowest rank sets the step, on both sides.
        planned, uncompressed = self.control.agree([spans[len(spans) // 2], self._verify_baseline_s],
                                                   op=dist.ReduceOp.MAX)
        self._verify_baseline_s = None
        reason = verify_plan(uncompressed, planned)
        if reason is None:
            self.verification = (f"kept: measured {planned * 1e3:.1f} ms per backward+sync against "
                                 f"{uncompressed * 1e3:.1f} ms uncompressed")
            if dist.get_rank() == 0:
                log.info("sync %s: plan %s", self.name, self.verification)
            return
        self.verification = f"reverted to allreduce: {reason}"
        self.decisions = {i: "allreduce" for i in self.decisions}
        if self.guard is not None:
            self.guard.compressing = False
        if dist.get_rank() == 0:
            log.warning("sync %s: %s", self.name, self.verification)

    def _measure_costs(self, order: list[int], step: _Step) -> dict[tuple[int, str], float]:
        """Local compute time of each candidate codec on each bucket (no communication)."""
        from .compress import make_codec

        solo = Wire(None, size=1)
        cost_model = as_cost(self.link, self.world_size)
        costs: dict[tuple[int, str], float] = {}
        gen = torch.Generator(device=self.device).manual_seed(0)
        for name in self.policy["candidates"]:
            for i in order:
                numel = step.numel[i]
                if name == "allreduce":
                    costs[(i, name)] = 0.0
                    continue
                trial = make_codec(name, **self.policy.get("options", {}).get(name, {}))
                # What the codec is given: the bucket, or (hierarchical) its 1/k shard.
                numel, layout = cost_model.codec_input(numel, self._layouts.get(step.keys.get(i)))
                # On the training device, timed by its clock: a codec's cost on the GPU
                # is kernel time, not the host time of launching it.
                # A private generator: measuring must not move the training's RNG streams.
                x = torch.randn(numel, device=self.device, generator=gen)
                marks = [self.clock.mark()]
                for _ in range(_COST_RUNS):  # later runs have warm-start state, like steady state
                    trial.reduce(x, solo, step.keys.get(i, i), layout)
                    marks.append(self.clock.mark())
                self.clock.synchronize(marks[-1:])
                times = [duration_s(a, b) for a, b in zip(marks, marks[1:])]
                costs[(i, name)] = min(times[1:])  # the least disturbed by other processes
        return costs


# Timed runs of each candidate codec per bucket when auto decides (the first one, cold, is
# dropped). Five: one burst of other load on a shared core can inflate two or three of them
# several-fold (seen: PowerSGD costed at 10x its steady time, and auto chose bf16 at 1 Gbit/s).
_COST_RUNS = 6


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
