"""``accelerate()``: a plain model and optimizer in, a distributed one out.

What it does, in this order (each step one function, like torchtitan's
parallelisms): activation checkpointing of chosen module types -> move to the
device -> DDP (fused buckets overlapping backward, gradients as bucket views)
-> gradient-sync strategy -> precision (autocast, fp16 scaler) -> accumulation
and clipping at step time -> metrics.

Example::

    rt = slipstream.init()
    run = slipstream.accelerate(model, optimizer, precision="bf16", accumulate_steps=4)
    for x, y in loader:
        loss = F.cross_entropy(run.model(x), y)
        run.backward(loss)      # scaled, divided by accumulate_steps, syncs on the last micro-step only
        run.step()              # clip + optimizer step + zero_grad on the boundary, else nothing
    run.finish()
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .. import sync
from ..config import TrainConfig
from ..checkpoint import CheckpointManager
from ..checkpoint.states import CallbackState, ModelOptimizerState, RNGState
from ..errors import EXIT_PREEMPTED, ConfigError
from ..fault import progress
from ..fault.progress import ProgressReporter, diagnose_hang, is_collective_failure
from ..metrics import StepRecorder
from ..runtime import Runtime, current
from .activation_checkpointing import apply_activation_checkpointing
from .precision import autocast, grad_scaler, outputs_to_fp32


class _MicroSteps:
    """Which micro-step we are in; decides whether this backward synchronises."""

    def __init__(self, accumulate_steps: int) -> None:
        self.accumulate_steps = accumulate_steps
        self.index = 0  # micro-steps done since the last optimizer step
        self.total = 0  # micro-steps done since the start of training (resumed from checkpoints)

    @property
    def syncs(self) -> bool:
        # Only the last micro-step of an accumulation window all-reduces: the
        # earlier ones just add into the local gradient, which is exact
        # because the all-reduce is linear.
        return self.index == self.accumulate_steps - 1


class SlipstreamDDP(DistributedDataParallel):
    """DDP whose forward runs under autocast, counts samples, and arms or
    disarms gradient synchronisation for the coming backward."""

    def _slipstream_setup(self, micro: _MicroSteps, precision: str, device: torch.device, recorder: StepRecorder):
        self._sl_micro = micro
        self._sl_precision = precision
        self._sl_device = device
        self._sl_recorder = recorder
        self._sl_progress: ProgressReporter | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sl_progress is not None:
            self._sl_progress.mark(progress.FORWARD)
        # DDP reads this flag in forward to decide whether the next backward
        # reduces gradients (the same mechanism as its no_sync() context).
        self.require_backward_grad_sync = self._sl_micro.syncs
        first = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(first, torch.Tensor) and first.dim() >= 1:
            self._sl_recorder.add_samples(first.shape[0])
            if first.dim() >= 2 and not first.is_floating_point():
                self._sl_recorder.add_tokens(first.numel())  # token ids: (batch, seq)
        timing = self._sl_recorder.begin("forward")
        with autocast(self._sl_precision, self._sl_device):
            out = super().forward(*args, **kwargs)
        self._sl_recorder.end("forward", timing)
        return outputs_to_fp32(out)


class Accelerated:
    """The wrapped model and optimizer, and the step logic around them."""

    def __init__(
        self,
        model: SlipstreamDDP,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: TrainConfig,
        runtime: Runtime,
        recorder: StepRecorder,
        scheduler: Any = None,
        sync_state: Any = None,
    ) -> None:
        self.model = model
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.runtime = runtime
        self.recorder = recorder
        self.scheduler = scheduler
        self.sync_state = sync_state
        self.scaler = grad_scaler(config.precision, runtime.device)
        self._micro = model._sl_micro
        self.step_count = 0
        self.resumed_from_step: int | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.checkpoints: CheckpointManager | None = None
        # Heartbeats also go to RUN_DIR/progress: on NCCL the launcher's hang report
        # (from flight-recorder dumps) adds where each rank's host code was.
        progress_dir = os.path.join(recorder.run_dir, "progress") if recorder.run_dir else None
        self.progress = (ProgressReporter(runtime.rank, runtime.world_size, progress_dir=progress_dir)
                         if runtime.world_size > 1 else None)
        model._sl_progress = self.progress
        self._observe_loss = getattr(sync_state, "observe_loss", None)

    @property
    def micro_step_count(self) -> int:
        """Micro-steps done since training began (restored on resume): index data by it."""
        return self._micro.total

    def _enable_checkpoints(self, extra_state: dict[str, Any]) -> None:
        cfg = self.config
        mgr = CheckpointManager(
            cfg.checkpoint_dir,  # type: ignore[arg-type]
            every_steps=cfg.checkpoint_every_steps,
            every_s=cfg.checkpoint_every_s,
            keep_last=cfg.checkpoint_keep_last,
            async_save=cfg.checkpoint_async,
            preemption_deadline_s=cfg.preemption_deadline_s,
            verify=cfg.checkpoint_verify,
            max_failures=cfg.checkpoint_max_failures,
        )
        mgr.register("model_optimizer", self._model_optimizer_state())
        mgr.register("train", CallbackState(self._counters_state, self._load_counters_state))
        for name, obj in extra_state.items():
            mgr.register(f"extra.{name}", obj)
        mgr.register("rng", RNGState(), per_rank=True)
        if self.sync_state is not None and hasattr(self.sync_state, "state_dict"):
            mgr.register("sync", self.sync_state, per_rank=True)
        self.checkpoints = mgr
        step = mgr.restore_latest()
        if step:
            self.resumed_from_step = step
            if self.runtime.is_main:
                print(f"[slipstream] resumed from {cfg.checkpoint_dir} at step {step}", flush=True)

    def _model_optimizer_state(self) -> ModelOptimizerState:
        return ModelOptimizerState(self.model, self.optimizer)  # DDP: the state-dict API strips ``module.``

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: pick the data slice by it."""
        return self.runtime.rank

    @property
    def dp_size(self) -> int:
        """How many data-parallel ranks there are (global batch = per-rank batch * dp_size)."""
        return self.runtime.world_size

    def describe_layout(self) -> str:
        """The parallel layout in words, e.g. ``pp(1) x dp_replicate(2) x dp_shard(1) x tp(1)``."""
        return f"pp(1) x dp_replicate({self.runtime.world_size}) x dp_shard(1) x tp(1)"

    def train_step(self, inputs: Any, target: Any, loss_fn: Any) -> torch.Tensor:
        """One micro-step: forward, ``loss_fn(output, target)``, backward, :meth:`step`.

        The same loop then works for every layout, pipeline parallelism included
        (where forward and backward run interleaved in a schedule). Returns the
        loss (detached; on every rank).

        Example::

            loss = run.train_step(x, y, lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
        """
        loss = loss_fn(self.model(inputs), target)
        self.backward(loss)
        self.step()
        return loss.detach()

    def _grad_norm_due(self) -> bool:
        """Whether step() computes the gradient norm for the metrics itself (layouts that
        shard the model). Under DDP every rank holds the whole gradient: the recorder's
        optimizer hook measures it on log steps without help."""
        return False

    def _global_grad_norm(self) -> torch.Tensor:
        return torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def _counters_state(self) -> dict[str, Any]:
        return {
            "step": self.step_count,
            "micro_step": self._micro.total,
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
        }

    def _load_counters_state(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        self._micro.total = int(state["micro_step"])
        self._micro.index = 0
        self.recorder.step = self.step_count
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])

    def _exit_preempted(self) -> None:
        if self.runtime.is_main:
            mgr = self.checkpoints
            written = (f"checkpoint of step {self.step_count} written" if mgr is None or not mgr.last_save_failed
                       else f"the emergency checkpoint of step {self.step_count} failed (above); the newest one "
                            f"is step {mgr.last_saved_step}")
            print(f"[slipstream] preempted (SIGTERM): {written}; exiting with code {EXIT_PREEMPTED}", flush=True)
        self.recorder.close()
        raise SystemExit(EXIT_PREEMPTED)

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def is_sync_step(self) -> bool:
        """True when the coming backward synchronises gradients (last micro-step)."""
        return self._micro.syncs

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-step's loss (averaged over the accumulation window)."""
        self.recorder.add_loss(loss)
        if self._micro.accumulate_steps > 1:
            loss = loss / self._micro.accumulate_steps
        self._mark(progress.BACKWARD if self._micro.syncs else progress.BACKWARD_LOCAL)
        if self._micro.syncs and self._observe_loss is not None:
            self._observe_loss(loss.detach())  # the convergence guard's loss trend (read only at its checks)
        timing = self.recorder.begin("backward")
        try:
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        except Exception as exc:  # noqa: BLE001 - re-raised, with a diagnosis when a peer hung or died
            self._raise_diagnosed(exc)
        self.recorder.end("backward", timing)

    def _mark(self, phase: str, step: int | None = None) -> None:
        if self.progress is not None:
            self.progress.mark(phase, step)

    def _raise_diagnosed(self, exc: BaseException) -> None:
        if self.progress is not None and is_collective_failure(exc):
            raise diagnose_hang(self.progress, exc, self.runtime.timeout_s, self.recorder.run_dir) from exc
        raise exc

    def step(self) -> bool:
        """End a micro-step; on the last one clip, step, zero the gradients.

        Returns True when the optimizer stepped.
        """
        self._micro.total += 1
        if not self._micro.syncs:
            self._micro.index += 1
            return False
        self._micro.index = 0
        self._mark(progress.OPTIMIZER)
        timing = self.recorder.begin("optimizer")
        if self.config.grad_clip_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            self.last_grad_norm = self._clip_gradients(self.config.grad_clip_norm)
        elif self._grad_norm_due():
            self.last_grad_norm = self._global_grad_norm()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.recorder.end("optimizer", timing)
        self.step_count += 1
        if self.checkpoints is not None:
            self._mark(progress.CHECKPOINT)
            try:
                with self.recorder.timed("checkpoint"):
                    preempted = self.checkpoints.maybe_save(self.step_count)
            except Exception as exc:  # noqa: BLE001
                self._raise_diagnosed(exc)
            if preempted:
                self._exit_preempted()
        if self.last_grad_norm is not None:
            self.recorder.set("grad_norm", self.last_grad_norm)  # a tensor: read back at log time only
        self._mark(progress.METRICS)
        try:
            # On log steps this exchanges per-rank timings (straggler detection).
            self.recorder.end_step(lr=self.optimizer.param_groups[0]["lr"])
        except Exception as exc:  # noqa: BLE001
            self._raise_diagnosed(exc)
        self._mark(progress.USER, self.step_count)
        return True

    def unwrapped_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's state_dict (no ``module.`` prefix, no wrapper names)."""
        return self.module.state_dict()

    def finish(self) -> dict[str, Any]:
        """Flush metrics and return a summary (steps, elapsed_s, final_loss, throughput)."""
        if self.checkpoints is not None:
            if self.checkpoints.last_saved_step != self.step_count and self.step_count > 0:
                self.checkpoints.save(self.step_count, blocking=True)  # the final state, for a clean resume
            self.checkpoints.close()
        if self.progress is not None:
            self.progress.close()
        if hasattr(self.sync_state, "close"):
            self.sync_state.close()
        self.recorder.flush()
        summary = self.recorder.summary()
        self.recorder.close()
        return summary


def _build_optimizer(optimizer: Any, params: Any) -> torch.optim.Optimizer:
    """An optimizer as given, or built by the factory given."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    built = optimizer(params)
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(f"the optimizer factory must return a torch.optim.Optimizer, got {type(built).__name__}")
    return built


def _build_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """A scheduler as given, or built by the factory given (a callable without ``step``)."""
    if scheduler is None or hasattr(scheduler, "step"):
        return scheduler
    if callable(scheduler):
        return scheduler(optimizer)
    raise ConfigError(f"scheduler must have step() or be a factory optimizer -> scheduler, got {type(scheduler).__name__}")


def _agree_run_dir(config: TrainConfig, runtime: Runtime) -> str:
    """Every rank writes under the same run directory; rank 0 chooses it."""
    chosen = [config.run_dir or os.environ.get("SLIPSTREAM_RUN_DIR")]
    if chosen[0] is None and runtime.is_main:
        chosen[0] = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if runtime.world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]  # type: ignore[return-value]


def _new_recorder(config: TrainConfig, runtime: Runtime) -> StepRecorder:
    """The run's metrics recorder, writing under the run directory every rank agreed on."""
    return StepRecorder(
        rank=runtime.rank,
        world_size=runtime.world_size,
        run_dir=_agree_run_dir(config, runtime),
        log_every_steps=config.log_every_steps,
        total_steps=config.total_steps,
        progress=config.progress,
    )


def accelerate(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer],
    config: TrainConfig | None = None,
    *,
    scheduler: Any = None,
    extra_state: dict[str, Any] | None = None,
    tp_plan: dict[str, Any] | None = None,
    pp_split_points: list[str] | None = None,
    **options: Any,
) -> Accelerated:
    """Wrap ``model`` and ``optimizer`` for distributed training.

    ``config`` (a :class:`TrainConfig`) wins as a whole; otherwise the fields
    come from ``SLIPSTREAM_*`` environment variables (set by ``slipstream run
    --sync/--precision/...``) overridden by ``options``.
    ``optimizer``: an optimizer, or a factory ``params -> optimizer``. Layouts
    that shard or split the model (dp_shard, tp, pp; docs/parallel.md) replace
    its parameters, so there the optimizer is built over the new ones: a factory
    is called with them; an optimizer without state yet is rebuilt (same class,
    same per-group hyperparameters, matched by parameter name).
    ``scheduler`` (optional) is stepped after every optimizer step; give a
    factory ``optimizer -> scheduler`` when the optimizer is a factory or rebuilt.
    ``tp_plan`` (with tp > 1): module-name pattern -> "colwise"/"rowwise"
    (see :mod:`slipstream.parallel.tensor_parallel`). ``pp_split_points``
    (with pp > 1): names of the units where stages begin (default: layers split
    evenly; see :mod:`slipstream.parallel.pipeline`).
    ``extra_state`` (optional): more objects with ``state_dict()``/``load_state_dict()``
    (a data sampler, say) saved in every checkpoint. With ``checkpoint_dir``
    set, the run resumes from the newest complete checkpoint there; read
    ``run.step_count`` and ``run.micro_step_count`` to continue the loop.

    Example::

        run = slipstream.accelerate(model, opt, precision="bf16", grad_clip_norm=1.0)
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, DistributedDataParallel):
        raise ConfigError("model is already wrapped in DistributedDataParallel; pass the plain module")
    if not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer or a factory params -> Optimizer, got {type(optimizer).__name__}"
        )
    # An option given as None counts as not given: the environment's default stays.
    options = {key: value for key, value in options.items() if value is not None}
    if config is None:
        config = TrainConfig.from_env(**options)
    elif options:
        raise ConfigError(f"give either config or keyword options, not both (got {', '.join(options)})")
    runtime = current()
    if not config.is_plain_data_parallel(runtime.world_size):
        from .parallel_run import accelerate_parallel

        return accelerate_parallel(
            model, optimizer, config, runtime,
            scheduler=scheduler, extra_state=extra_state, tp_plan=tp_plan, pp_split_points=pp_split_points,
        )
    # tp_plan and pp_split_points are ignored here (no TP, no PP): one script runs under every layout.
    optimizer = _build_optimizer(optimizer, model.parameters())
    scheduler = _build_scheduler(scheduler, optimizer)
    owned = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in owned)
    if foreign:
        raise ConfigError(f"the optimizer holds {foreign} parameter(s) that are not in the model")

    apply_activation_checkpointing(model, config.activation_checkpointing)
    model.to(runtime.device)

    recorder = _new_recorder(config, runtime)
    micro = _MicroSteps(config.accumulate_steps)
    ddp = SlipstreamDDP(
        model,
        device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
        bucket_cap_mb=config.bucket_cap_mb,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
    )
    ddp._slipstream_setup(micro, config.precision, runtime.device, recorder)
    try:
        sync_state = sync.apply(config.sync, ddp, **config.sync_options)
    except (TypeError, ValueError) as exc:  # an option the strategy does not take, or a bad value
        raise ConfigError(f"sync_options for {config.sync!r}: {exc}") from None
    if sync_state is not None and hasattr(sync_state, "stats"):
        recorder.sources.append(sync_state.stats)
    recorder.attach(ddp.module, config, runtime.device, runtime.local_rank, optimizer)  # phase hooks, sinks
    run = Accelerated(ddp, model, optimizer, config, runtime, recorder, scheduler=scheduler, sync_state=sync_state)
    if config.checkpoint_dir is not None:
        run._enable_checkpoints(extra_state or {})
    elif extra_state:
        raise ConfigError("extra_state is saved in checkpoints: set checkpoint_dir too")
    return run
