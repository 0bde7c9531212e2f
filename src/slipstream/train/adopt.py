"""Zero-change acceleration: the DistributedDataParallel a script builds itself gets Slipstream.

``slipstream run --sync powersgd train.py`` runs an unmodified script (a plain DDP
loop, the Hugging Face ``Trainer``, Accelerate, Lightning): the worker entry calls
:func:`install` before the script starts, and every
:class:`~torch.nn.parallel.DistributedDataParallel` the script (or its framework)
then constructs is *adopted* right after DDP's own constructor:

* the gradient-sync strategy is installed through the same engine as
  :func:`slipstream.accelerate` (:func:`slipstream.sync.apply`, after the same
  bucket-order fix), ``auto`` included (probe, decision, verification, guard);
* the step metrics (per-phase times, communication, bytes, compression ratio,
  straggler verdict), the heartbeats of the hang report, and ``RUN_DIR/metrics``
  for ``slipstream report``: step boundaries are the optimizer steps of the
  optimizers that hold the model's parameters (torch's global optimizer hooks);
  the loss is the one the model returns (``output.loss``, as Hugging Face models
  compute it), read when the micro-step ends (after the loop's own in-place
  rescaling), and is absent from the records otherwise;
* the options with a well-defined meaning outside our loop: ``precision bf16``
  (autocast around the DDP forward, outputs back in fp32), ``grad_clip_norm``
  (clipped right before each optimizer step, after a GradScaler's unscale),
  ``activation_checkpointing`` (wrapped before DDP sees the module), and DDP's
  own constructor options (``bucket_cap_mb``, ...), which override the script's.

Every other option given to ``slipstream run`` cannot reach a loop it does not
own; rank 0 prints one line per such option when the model is adopted
(:data:`NOT_APPLIED` says why, option by option), and, when the script built no
DDP model and did not call :func:`slipstream.accelerate`, one line at exit saying
that none of the options applied.

Nothing is installed without a training option: under ``slipstream run`` with no
option the script runs exactly as under torchrun. A DDP built by
:func:`slipstream.accelerate` (``SlipstreamDDP``) is never adopted: it has all of
this already.

Example::

    adopter = install()             # in the worker, before the script runs
    ...                             # the script: model = DDP(net); loop with opt.step()
    adopter.finish()                # after the script: flush metrics, close the strategy
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .. import sync
from ..config import TrainConfig, env_text, options_in_env
from ..errors import ConfigError, SlipstreamError
from ..fault import progress
from ..fault.progress import ProgressReporter, diagnose_hang, is_collective_failure
from ..log import CONSOLE
from ..metrics import StepRecorder
from ..parallel.activation_checkpointing import apply_activation_checkpointing
from .bucket_order import fix_bucket_order
from .microsteps import count_inputs
from .precision import autocast, outputs_to_fp32

DDP_OPTIONS = {
    "bucket_cap_mb": "bucket_cap_mb",
    "gradient_as_bucket_view": "gradient_as_bucket_view",
    "find_unused_parameters": "find_unused_parameters",
    "static_graph": "static_graph",
}
"""Flat option -> DDP constructor argument: applied by overriding what the script passes."""

APPLIED = frozenset({
    "sync", "sync_options", *DDP_OPTIONS, "grad_clip_norm", "activation_checkpointing",
    "profile", "timeline", "tensorboard", "prometheus_port", "prometheus_addr", "flops_per_sample", "peak_flops",
    "straggler_threshold", "log_to", "run_dir", "log_every_steps", "progress", "total_steps",
})
"""Options an adopted DDP model gets (``precision`` too, for bf16 and fp32: see :data:`NOT_APPLIED`)."""

_LAYOUT = ("the script builds its own DistributedDataParallel, which replicates the whole model: layouts "
           "(docs/parallel.md) need slipstream.accelerate()")
_CHECKPOINT = ("Slipstream's checkpoints hold the loop's state, which only slipstream.accelerate() owns: use the "
               "script's own checkpoints (Trainer save_steps, Lightning ModelCheckpoint)")
NOT_APPLIED: dict[str, str] = {
    "accumulate_steps": ("the script's loop decides when the optimizer steps: use its own option (Trainer "
                         "gradient_accumulation_steps, Lightning accumulate_grad_batches)"),
    "dp_replicate": _LAYOUT, "dp_shard": _LAYOUT, "tp": _LAYOUT, "pp": _LAYOUT, "pp_schedule": _LAYOUT,
    "pp_microbatches": _LAYOUT, "zero_stage": _LAYOUT,
    "checkpoint_dir": _CHECKPOINT, "checkpoint_every_steps": _CHECKPOINT, "checkpoint_every_s": _CHECKPOINT,
    "checkpoint_keep_last": _CHECKPOINT, "checkpoint_async": _CHECKPOINT, "checkpoint_verify": _CHECKPOINT,
    "checkpoint_max_failures": _CHECKPOINT, "preemption_deadline_s": _CHECKPOINT,
    "snapshot_every_steps": _CHECKPOINT, "snapshot_peer_copy": _CHECKPOINT,
}
"""Options that cannot reach a loop the script owns, and why (one start-up line each)."""

FP16_NOT_APPLIED = ("fp16 needs a loss scaler inside the loop, which the script owns: use its own fp16 option "
                    "(Trainer fp16=True, Lightning precision='16-mixed', torch.amp.GradScaler)")

log = logging.getLogger(__name__)

_ADOPTER: "Adopter | None" = None
_ORIGINAL_INIT = DistributedDataParallel.__init__


def install(environ: Mapping[str, str] | None = None) -> "Adopter | None":
    """Adopt every DDP model the script builds from now on; None when no training option was
    given (the script then runs as under torchrun). Idempotent.

    Raises ConfigError (exit 2, before the script runs) for a value TrainConfig refuses.
    """
    global _ADOPTER
    environ = os.environ if environ is None else environ
    if _ADOPTER is not None:
        return _ADOPTER
    given = options_in_env(environ)
    if not given:
        return None
    _ADOPTER = Adopter(TrainConfig.from_env(environ), given)
    DistributedDataParallel.__init__ = _adopting_init  # type: ignore[method-assign]
    return _ADOPTER


def uninstall() -> None:
    """Stop adopting (models adopted so far keep their strategy); for tests."""
    global _ADOPTER
    DistributedDataParallel.__init__ = _ORIGINAL_INIT  # type: ignore[method-assign]
    _ADOPTER = None


def current() -> "Adopter | None":
    """The installed adopter, if any."""
    return _ADOPTER


@functools.wraps(_ORIGINAL_INIT)
def _adopting_init(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
    adopter = _ADOPTER
    if adopter is None or _built_by_slipstream(self):
        _ORIGINAL_INIT(self, *args, **kwargs)
        return
    bound = inspect.signature(_ORIGINAL_INIT).bind(self, *args, **kwargs)
    adopter.before_init(bound.arguments)
    _ORIGINAL_INIT(*bound.args, **bound.kwargs)
    adopter.adopt(self)


def _built_by_slipstream(ddp: DistributedDataParallel) -> bool:
    from .layout_dp import SlipstreamDDP

    return isinstance(ddp, SlipstreamDDP)



def parameter_count(n: int) -> str:
    """A parameter count for a start-up line, in a unit that shows it: a small model's 162
    parameters were "0.00M" before.

    Example::

        parameter_count(162), parameter_count(85_002), parameter_count(2_180_000)   # "162", "85.0k", "2.18M"
    """
    if n < 1_000:
        return str(n)
    if n < 1_000_000:
        return f"{n / 1e3:.1f}k"
    if n < 1_000_000_000:
        return f"{n / 1e6:.2f}M"
    return f"{n / 1e9:.2f}B"

class Adopter:
    """What :func:`install` installs: adopts DDP models, times their steps, reports what did not apply."""

    def __init__(self, config: TrainConfig, given: list[str]) -> None:
        self.config = config
        self.given = given
        self.models: list[DistributedDataParallel] = []
        self.handles: list[sync.SyncHandle] = []
        self.recorder: StepRecorder | None = None
        self.progress: ProgressReporter | None = None
        self._params: set[int] = set()
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        self._hooks: list[Any] = []
        self._optimizer_timing: Any = None
        self._backward_timing: Any = None
        self._pending_loss: tuple[torch.Tensor, sync.SyncHandle | None] | None = None
        self._notes: list[str] = []
        self._finished = False
        self.accelerate_called = False  # set by slipstream.accelerate(): the options reached its loop

    # --- construction -------------------------------------------------------------------
    def before_init(self, arguments: dict[str, Any]) -> None:
        """Change DDP's constructor arguments: the given DDP options, activation checkpointing."""
        flat = self.config.flat()
        for option, argument in DDP_OPTIONS.items():
            if option not in self.given:
                continue
            if argument in arguments and arguments[argument] not in (None, flat[option]):
                self._notes.append(f"--{option.replace('_', '-')} {flat[option]} overrides the script's "
                                   f"{argument}={arguments[argument]!r}")
            arguments[argument] = flat[option]
        names = self.config.parallel.activation_checkpointing
        if names:
            apply_activation_checkpointing(arguments["module"], tuple(names))

    def adopt(self, ddp: DistributedDataParallel) -> None:
        """Install the strategy on a freshly built DDP model (every rank, before its first forward)."""
        strategy = self.config.sync.strategy
        if sync.describe(strategy).fixes_bucket_order:  # diloco sums no gradient: no layout to fix (layout_dp says why)
            fix_bucket_order(ddp)
        try:
            handle = sync.apply(strategy, ddp, **self.config.sync.options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"sync_options for {strategy!r}: {exc}") from None
        self.models.append(ddp)
        self.handles.append(handle)
        _refuse_second_comm_hook(ddp, strategy)
        first = len(self.models) == 1
        if first:
            self._instrument(ddp, handle)
        _wrap_forward(ddp, self, handle, instrumented=first)
        if first and dist.get_rank() == 0:
            self._announce(ddp, handle)

    def _instrument(self, ddp: DistributedDataParallel, handle: sync.SyncHandle) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        run_dir = self.config.run.dir or os.environ.get("SLIPSTREAM_RUN_DIR")
        device = next((p.device for p in ddp.module.parameters()), torch.device("cpu"))
        run = self.config.run
        recorder = StepRecorder(rank=rank, world_size=world, run_dir=run_dir, log_every_steps=run.log_every_steps,
                                total_steps=run.total_steps, progress=run.progress)
        try:
            recorder.attach(ddp.module, self.config, device, int(os.environ.get("LOCAL_RANK", rank)))
        except Exception:
            recorder.close()
            raise
        recorder.sources.append(handle.stats)
        self.recorder = recorder
        if world > 1:
            self.progress = ProgressReporter(rank, world, progress_dir=os.path.join(run_dir, "progress")
                                             if run_dir else None)
        self._params = {id(p) for p in ddp.module.parameters()}
        self._hooks = [
            register_optimizer_step_pre_hook(self._before_step),
            register_optimizer_step_post_hook(self._after_step),
        ]

    def _announce(self, ddp: DistributedDataParallel, handle: sync.SyncHandle) -> None:
        flat = self.config.flat()
        n = sum(p.numel() for p in ddp.module.parameters())
        applied = [f"{name} {env_text(flat[name])}" for name in self.given if name in APPLIED]
        precision = self.config.numerics.precision
        if "precision" in self.given and precision != "fp16":
            applied.insert(0, f"precision {precision}")
        log.info(f"[slipstream] adopted the script's DistributedDataParallel ({type(ddp.module).__name__}, "
                 f"{parameter_count(n)} parameters): {', '.join(applied) or 'metrics'}; gradient sync {handle.name}",
                 extra=CONSOLE)
        for note in self._notes:
            log.info(f"[slipstream] {note}", extra=CONSOLE)
        for line in self.not_applied_lines():
            log.info(line, extra=CONSOLE)

    def not_applied_lines(self) -> list[str]:
        """One line per given option an adopted model cannot get, naming it and why."""
        flat = self.config.flat()
        lines = [f"[slipstream] --{name.replace('_', '-')} {env_text(flat[name])} not applied: {NOT_APPLIED[name]}"
                 for name in self.given if name in NOT_APPLIED]
        if "precision" in self.given and self.config.numerics.precision == "fp16":
            lines.insert(0, f"[slipstream] --precision fp16 not applied: {FP16_NOT_APPLIED}")
        return lines

    # --- the loop -----------------------------------------------------------------------
    def on_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.progress is not None:
            self.progress.mark(progress.FORWARD)
        self._optimizer_timing = None  # a closure run inside optimizer.step (Lightning): not optimizer time
        assert self.recorder is not None
        self._end_backward()  # a micro-step without an optimizer step (accumulation)
        self._take_loss()
        count_inputs(self.recorder, args, kwargs)
        return self.recorder.begin("forward")

    def after_forward(self, token: Any, output: Any, handle: sync.SyncHandle, ddp: DistributedDataParallel) -> None:
        assert self.recorder is not None
        self.recorder.end("forward", token)
        loss = _model_loss(output)
        if loss is not None:
            # Read when the micro-step ends, not now: the loop may still rescale the very tensor
            # in place (the Hugging Face Trainer multiplies it by the number of processes when it
            # normalises by the tokens of all ranks), and the figure is the loss as the loop used it.
            self._pending_loss = (loss, handle if ddp.require_backward_grad_sync else None)
        start = _first_grad_tensor(output)
        if start is not None and torch.is_grad_enabled():
            start.register_hook(self._backward_begins)
        if self.progress is not None:
            self.progress.mark(progress.BACKWARD if ddp.require_backward_grad_sync else progress.BACKWARD_LOCAL)

    def _take_loss(self) -> None:
        """The last forward's loss, as the loop left it: into the metrics (a device copy, no sync)
        and, on a synchronising micro-step, to the strategy's convergence guard."""
        if self._pending_loss is None or self.recorder is None:
            return
        loss, handle = self._pending_loss
        self._pending_loss = None
        value = loss.to(torch.float32, copy=True)
        self.recorder.add_loss(value)
        if handle is not None:
            handle.observe_loss(value)

    def _backward_begins(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient of the model's output is ready: the backward through the model starts.
        It ends (the reducer's wait included) at the next optimizer step or forward: the
        script's code between its backward and its step counts as exposed communication."""
        if self._backward_timing is None and self.recorder is not None:
            self._backward_timing = self.recorder.begin("backward")
        return grad

    def _end_backward(self) -> None:
        if self._backward_timing is not None and self.recorder is not None:
            self.recorder.end("backward", self._backward_timing)
        self._backward_timing = None

    def _ours(self, optimizer: torch.optim.Optimizer) -> bool:
        known = self._optimizers.get(optimizer)
        if known is None:
            known = any(id(p) in self._params for group in optimizer.param_groups for p in group["params"])
            self._optimizers[optimizer] = known
            if known:
                for handle in self.handles:
                    handle.attach_optimizer(optimizer)
        return known

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._finished or not self._ours(optimizer):
            return
        if self.progress is not None:
            self.progress.mark(progress.OPTIMIZER)
        assert self.recorder is not None
        self._end_backward()
        self._take_loss()
        model = self.models[0].module
        clip = self.config.numerics.grad_clip_norm
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            self.recorder.set("grad_norm", norm.detach())
        elif self.recorder.next_step_logs:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if grads:
                self.recorder.set("grad_norm", torch.nn.utils.get_total_norm(grads))
        self._optimizer_timing = self.recorder.begin("optimizer")

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._finished or not self._ours(optimizer):
            return
        assert self.recorder is not None
        self._end_backward()  # a closure's backward (Lightning) ran inside optimizer.step
        self._take_loss()
        if self._optimizer_timing is not None:
            self.recorder.end("optimizer", self._optimizer_timing)
            self._optimizer_timing = None
        for handle in self.handles:
            handle.after_optimizer_step()  # diloco: the outer step when due (every rank, same step)
        self.recorder.end_step(lr=optimizer.param_groups[0]["lr"])  # log steps: the straggler gather
        if self.progress is not None:
            self.progress.mark(progress.USER, self.recorder.step)

    # --- the end ------------------------------------------------------------------------
    def diagnose(self, exc: BaseException) -> SlipstreamError | None:
        """The hang report for a collective that failed in the script (None when not one)."""
        if self.progress is None or self.recorder is None or not is_collective_failure(exc):
            return None
        from ..process.runtime import group_timeout

        return diagnose_hang(self.progress, exc, group_timeout().total_seconds(), self.recorder.run_dir)

    def finish(self) -> None:
        """After the script: the last metrics window, heartbeats and strategies closed; the
        line saying nothing applied when the script built no DDP and did not call accelerate()."""
        if self._finished:
            return
        self._finished = True
        for hook in self._hooks:
            hook.remove()
        self._take_loss()
        if self.recorder is not None:
            self.recorder.straggler = None  # no collective at exit: ranks may leave at different times
            self.recorder.close()
        if self.progress is not None:
            self.progress.close()
        for handle in self.handles:
            try:
                handle.close()
            except Exception:  # noqa: BLE001 - the script may have destroyed the process group already
                pass
        if not self.models and _rank() == 0 and not self.accelerate_called:
            names = ", ".join(f"--{n.replace('_', '-')}" for n in self.given)
            log.info(f"[slipstream] {names} not applied: the script built no DistributedDataParallel model and did "
                     "not call slipstream.accelerate() (docs/zero-change.md)", extra=CONSOLE)


def _wrap_forward(ddp: DistributedDataParallel, adopter: Adopter, handle: sync.SyncHandle, instrumented: bool) -> None:
    """The instance's forward: metrics around it when ``instrumented``, bf16 autocast when asked."""
    inner = ddp.forward
    precision = adopter.config.numerics.precision
    cast = precision == "bf16" and "precision" in adopter.given
    device = next((p.device for p in ddp.module.parameters()), torch.device("cpu"))

    def forward(*args: Any, **kwargs: Any) -> Any:
        token = adopter.on_forward(args, kwargs) if instrumented else None
        if cast:
            with autocast("bf16", device):
                out = outputs_to_fp32(inner(*args, **kwargs))
        else:
            out = inner(*args, **kwargs)
        if instrumented:
            adopter.after_forward(token, out, handle, ddp)
        return out

    ddp.forward = forward  # type: ignore[method-assign]


def _refuse_second_comm_hook(ddp: DistributedDataParallel, strategy: str) -> None:
    """A comm hook the script registers after ours would fail in DDP with a bare RuntimeError."""
    if not sync.describe(strategy).installs_comm_hook:  # DDP's own reducer: the script's hook is the only one
        return

    def refuse(*_args: Any, **_kwargs: Any) -> None:
        raise ConfigError(f"the script registers its own DDP communication hook, but slipstream run --sync "
                          f"{strategy} installed one on this model already: drop one of the two")

    ddp.register_comm_hook = refuse  # type: ignore[method-assign]
    ddp._register_builtin_comm_hook = refuse  # type: ignore[method-assign]


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The loss the model returned, else the first output tensor that requires grad: its
    gradient is the first thing a backward through the model computes."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    candidates = [loss, output]
    while candidates:
        value = candidates.pop(0)
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return value
        elif isinstance(value, Mapping):
            candidates.extend(value.values())
        elif isinstance(value, (list, tuple)):
            candidates.extend(value)
    return None


def _model_loss(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss.detach() if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None



def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def mark_accelerate_called() -> None:
    """:func:`slipstream.accelerate` ran while options are adopted: they reached its loop."""
    if _ADOPTER is not None:
        _ADOPTER.accelerate_called = True


__all__ = ["install", "uninstall", "current", "mark_accelerate_called", "Adopter", "APPLIED", "NOT_APPLIED",
           "DDP_OPTIONS"]
