"""``accelerate()``: a plain model and optimizer in, a distributed one out.

One facade, one layout strategy. :func:`accelerate` checks its inputs once,
builds the layout the config asks for (:class:`~.layout_dp.DataParallelLayout`:
DDP with a gradient-sync strategy, the default; :class:`~.layout_mesh.MeshLayout`:
FSDP2 / TP / PP), the optimizer over the layout's parameters, the metrics
recorder and the checkpoints; :class:`Accelerated` runs the step around them:
precision (autocast, fp16 scaler) -> accumulation (sync on the last micro-step
only) -> clipping -> optimizer -> checkpoint -> metrics.

Example::

    rt = slipstream.init()
    run = slipstream.accelerate(model, optimizer, precision="bf16", accumulate_steps=4)
    for x, y in loader:
        loss = F.cross_entropy(run.model(x), y)
        run.backward(loss)          # scaled, divided by accumulate_steps, syncs on the last micro-step only
        if run.step().stop_requested:   # clip + step + zero_grad on the boundary; SIGTERM: checkpoint written
            break
    run.finish()

A Hugging Face model that computes its own loss takes its dict batch as is:
``outputs = run.model(**batch); run.backward(outputs.loss)``, or
``run.train_step(batch)``; outputs keep their type (``ModelOutput``) in every precision.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint import CheckpointManager
from ..checkpoint.states import CallbackState
from ..config import TrainConfig, check_parameter_dtype, resolve
from ..errors import ConfigError
from ..fault import progress
from ..fault.progress import ProgressReporter, diagnose_hang, is_collective_failure
from ..log import CONSOLE
from ..metrics import StepRecorder
from ..metrics.sinks import Sink
from ..process.runtime import Runtime, current
from ..resilience import heal
from ..sync import SyncHandle
from . import adopt, healing, resume
from .bookkeeping import new_recorder, open_checkpoints
from .checkpointing import Checkpointing
from .layout import Layout, LossFn
from .layout_dp import DataParallelLayout
from .layout_mesh import MeshLayout
from .microsteps import ForwardContext, MicroSteps
from .optimizer_build import OptimizerArg, build_scheduler, foreign_parameters
from .precision import grad_scaler, loss_scale
from .step_result import StepResult

log = logging.getLogger(__name__)


class Accelerated:
    """The wrapped model and optimizer, and the step logic around them (every layout).

    Built by :func:`accelerate`. ``run.model`` is the layout's front module,
    ``run.module`` the plain model (or this rank's pipeline stage).
    """

    def __init__(
        self,
        layout: Layout,
        optimizer: torch.optim.Optimizer,
        config: TrainConfig,
        runtime: Runtime,
        recorder: StepRecorder,
        micro: MicroSteps,
        progress_reporter: ProgressReporter | None = None,
        scheduler: Any = None,
    ) -> None:
        self.layout = layout
        self.optimizer = optimizer
        self.config = config
        self.runtime = runtime
        self.recorder = recorder
        self.scheduler = scheduler
        self.progress = progress_reporter
        self.scaler = grad_scaler(config.numerics.precision, runtime.device)
        if self.scaler is not None and layout.sync is not None:
            scaler = self.scaler  # fp16: error feedback kept in true-gradient units (scale stays on the device)
            layout.sync.use_loss_scale(lambda: loss_scale(scaler))
        self._micro = micro
        self._clip_norm = config.numerics.grad_clip_norm  # read at every step; the config is frozen
        self.step_count = 0
        self.resumed_from_step: int | None = None
        self.last_grad_norm: torch.Tensor | None = None
        self.checkpoints: CheckpointManager | None = None
        self.healer: heal.Healer | None = None  # set by accelerate() when this run heals in place
        # The collaborators: saving when due and rank 0's lines on preemption and resume
        # (train/checkpointing.py); the heal in place when this run heals (train/healing.py).
        self._checkpointing = Checkpointing(runtime)
        self._healing: healing.InPlaceHealing | None = None
        self._dropped = False  # the micro-step in hand was dropped by a heal: backward/step skip it

    # --- what the layout decides -----------------------------------------------------
    @property
    def model(self) -> nn.Module:
        """The front module: call it for the forward of a micro-step."""
        return self.layout.model

    @property
    def module(self) -> nn.Module:
        """The plain model, or this rank's pipeline stage (original parameter names)."""
        return self.layout.module

    @property
    def sync_state(self) -> SyncHandle | None:
        """The gradient-sync strategy's state (DDP layout; ``diloco`` on dp_shard replicas), for its ``stats()``."""
        return self.layout.sync

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks: pick the data slice by it."""
        return self.layout.dp_rank

    @property
    def dp_size(self) -> int:
        """How many data-parallel ranks there are (global batch = per-rank batch * dp_size)."""
        return self.layout.dp_size

    def describe_layout(self) -> str:
        """The parallel layout in words, e.g. ``pp(1) x dp_replicate(2) x dp_shard(1) x tp(1)``."""
        return self.layout.describe()

    def unwrapped_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state_dict, original names (no ``module.`` prefix, no wrapper
        names). On sharded layouts a collective: call it on every rank."""
        return self.layout.unwrapped_state_dict()

    def _clip_gradients(self, max_norm: float) -> torch.Tensor:
        # Kept for tests/parallel/test_clip_collectives.py, which times exactly this call.
        return self.layout.clip_gradients(max_norm)

    # --- counters ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @property
    def micro_step_count(self) -> int:
        """Micro-steps done since training began (restored on resume): index data by it."""
        return self._micro.total

    @property
    def is_sync_step(self) -> bool:
        """True when the coming backward synchronises gradients (last micro-step)."""
        return self._micro.syncs

    @property
    def stop_requested(self) -> bool:
        """True once a step reported ``stop_requested`` (SIGTERM, checkpoint written):
        the next training call raises ``SystemExit(EXIT_PREEMPTED)``."""
        return self._checkpointing.stop_reported

    # --- the loop ------------------------------------------------------------------------
    def train_step(self, inputs: Any, target: Any = None, loss_fn: LossFn | None = None) -> torch.Tensor:
        """One micro-step: forward, loss, backward, :meth:`step`. Two forms:

        * ``train_step(x, y, loss_fn)``: the model is called as ``model(x)`` (whatever
          ``x`` is) and the loss is ``loss_fn(output, y)``;
        * ``train_step(batch)`` (no ``loss_fn``): a Hugging Face style dict
          (``input_ids``, ``attention_mask``, ``labels``, ...) for a model that
          computes its own loss: the model is called as ``model(**batch)`` and the
          loss is ``output.loss`` (or ``output["loss"]``). A target without a
          ``loss_fn`` is refused.

        The same loop then works for every layout, pipeline parallelism included
        (where forward and backward run interleaved in a schedule; there only the
        first form, with a tensor ``x``: a stage cannot take the whole model's
        keywords, and refuses the second with a ConfigError). Returns the loss
        (on every rank) as a detached tensor on the training device, never a float:
        reading it (``.item()``, ``float()``) waits for the device to finish, so on a GPU
        read it on the steps you log only. Read ``run.stop_requested`` after it.

        Example::

            loss = run.train_step(x, y, lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
            loss = run.train_step({"input_ids": ids, "attention_mask": mask, "labels": ids})  # transformers
        """
        self._refuse_after_stop()
        if loss_fn is None and target is not None:
            raise ConfigError(
                "train_step got a target but no loss_fn: give train_step(inputs, target, loss_fn), or "
                "train_step(batch) with the labels in the batch for a model that computes its own loss"
            )
        pipeline = self.layout.pipeline
        if pipeline is None:
            if loss_fn is not None:
                loss = loss_fn(self.model(inputs), target)
            elif isinstance(inputs, Mapping):
                loss = _model_loss(self.model(**inputs))
            else:
                loss = _model_loss(self.model(inputs))
            self.backward(loss)
            self.step()
            return loss.detach()
        if loss_fn is None:
            raise ConfigError(
                f"with pp({self.config.parallel.pp}) give train_step(inputs, target, loss_fn) with a tensor of "
                f"inputs, got {type(inputs).__name__} inputs and no loss_fn: a pipeline stage runs part of the "
                "model on the previous stage's tensor, so a dict batch, or a loss the model computes itself "
                "(a Hugging Face model's output.loss), cannot be split into stages; use dp_shard/tp instead"
            )
        try:
            loss = pipeline.run(inputs, target, loss_fn)
        except Exception as exc:  # noqa: BLE001 - re-raised, with a diagnosis when a peer hung or died
            self._raise_diagnosed(exc)
        self.recorder.add_loss(loss)
        self.step()
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-step's loss (averaged over the accumulation window).

        ``loss`` is a scalar tensor: for a Hugging Face model called with ``labels``
        that is ``outputs.loss``.

        Example::

            outputs = run.model(**batch)    # input_ids, attention_mask, labels
            run.backward(outputs.loss)
        """
        self._refuse_after_stop()
        if not isinstance(loss, torch.Tensor):
            raise ConfigError(f"backward takes the loss tensor, got {_describe_loss(loss)}")
        if self._dropped:
            return
        if self.layout.pipeline is not None:
            self.model()  # raises the explanation: the schedule runs backward itself
        self.recorder.add_loss(loss)
        micro = self._micro
        if micro.accumulate_steps > 1:
            loss = loss / micro.accumulate_steps
        syncs = micro.syncs
        if self.progress is not None:
            self.progress.mark(progress.BACKWARD if syncs else progress.BACKWARD_LOCAL)
        sync = self.layout.sync
        if syncs and sync is not None:
            sync.observe_loss(loss)  # the convergence guard's loss trend (it detaches; read only at its checks)
        timing = self.recorder.begin("backward")
        try:
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
            else:
                loss.backward()
        except Exception as exc:  # noqa: BLE001 - re-raised, with a diagnosis when a peer hung or died
            self._heal_or_raise(exc)
            return
        self.recorder.end("backward", timing)

    def step(self) -> StepResult:
        """End a micro-step; on the last one of the window clip, step, zero the gradients,
        save a checkpoint when due, and record the metrics.

        Returns a :class:`StepResult` (``bool(result)``: the optimizer stepped). It never
        ends the process itself: after SIGTERM it writes the emergency checkpoint and
        returns ``stop_requested=True``; stop the loop then (``run.finish()``, exit with
        ``EXIT_PREEMPTED``). A loop that does not read it is still safe: the next
        ``backward()``, ``step()`` or ``train_step()`` raises ``SystemExit(EXIT_PREEMPTED)``
        (143; the checkpoint is complete, nothing is lost). Past ``preemption_deadline_s``
        after the signal the process exits 143 regardless.

        Example::

            if run.step().stop_requested:
                break
        """
        self._refuse_after_stop()
        if self._dropped:  # a heal restored the last snapshot: this micro-step never happened
            self._dropped = False
            return StepResult(stepped=False, step=self.step_count, healed=True)
        self._micro.total += 1
        if not self._micro.syncs:
            self._micro.index += 1
            return StepResult(stepped=False, step=self.step_count)
        self._micro.index = 0
        self._end_window_samples()
        if self.progress is not None:
            self.progress.mark(progress.OPTIMIZER)
        timing = self.recorder.begin("optimizer")
        self._clip_and_measure()
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.layout.sync is not None:
            # Every rank, every optimizer step (even one the fp16 scaler skipped): diloco's outer
            # step follows the count of steps. Before the checkpoint, which then holds its result.
            try:
                self.layout.sync.after_optimizer_step()
            except Exception as exc:  # noqa: BLE001 - an outer all-reduce a peer never joined: healed, or
                return self._healed_step(exc)  # the hang report (_heal_or_raise)
        self.recorder.end("optimizer", timing)
        self.step_count += 1
        saved = stop = False
        if self.checkpoints is not None:
            self._mark(progress.CHECKPOINT)
            try:
                with self.recorder.timed("checkpoint"):
                    saved, stop = self._checkpointing.save_when_due(self.checkpoints, self.step_count)
            except Exception as exc:  # noqa: BLE001
                return self._healed_step(exc)
        if self.last_grad_norm is not None:
            self.recorder.set("grad_norm", self.last_grad_norm)  # a tensor: read back at log time only
        if self.progress is not None:
            self.progress.mark(progress.METRICS)
        try:
            # On log steps this exchanges per-rank timings (straggler detection). The record's
            # fields are read there only.
            if self.recorder.next_step_logs:
                record = self.recorder.end_step(lr=self.optimizer.param_groups[0]["lr"])
            else:
                record = self.recorder.end_step()
        except Exception as exc:  # noqa: BLE001
            return self._healed_step(exc)
        if stop:
            self._checkpointing.report_stop(self.checkpoints, self.step_count)
        if self.progress is not None:
            self.progress.mark(progress.USER, self.step_count)
        return StepResult(stepped=True, step=self.step_count, saved=saved, logged=record is not None,
                          stop_requested=stop)

    def finish(self) -> dict[str, Any]:
        """Flush metrics and return a summary (steps, elapsed_s, final_loss, throughput).

        Writes a last checkpoint when the newest one is older than the current step. A resumed
        run whose loop took no step says that there was nothing left to train."""
        self._checkpointing.finish(self.checkpoints, self.step_count, self.resumed_from_step,
                                   self.config.run.total_steps)
        if self.progress is not None:
            self.progress.close()
        if self.layout.sync is not None:
            self.layout.sync.close()
        self.recorder.flush()
        summary = self.recorder.summary()
        self.recorder.close()
        return summary

    def register_state(self, name: str, obj: Any) -> Any:
        """Keep ``obj`` (anything with ``state_dict()``/``load_state_dict()``) in every checkpoint
        from now on, as ``extra_state={name: obj}`` would, and, when this run resumed, load its
        saved state now. Returns ``obj``. For what can only be built once the run exists: a data
        loader split by ``run.dp_rank``, whose position then resumes with the model, so no
        sample is read twice or skipped. Without ``checkpoint_dir`` there is nothing to keep, unless
        the run heals in place (its in-memory snapshots keep it): ``obj`` comes back unchanged. Every rank registers the same names in the same order.

        Example::

            loader = run.register_state("data", SlipstreamLoader(dataset, batch_size=8, rank=run.dp_rank,
                                                                 world_size=run.dp_size))
            for epoch in range(loader.epoch, epochs):     # a resumed run goes on in its epoch
                for batch in loader:
                    ...
        """
        if self.checkpoints is not None:
            self.checkpoints.register_restored(f"extra.{name}", obj)
        return obj

    def _end_window_samples(self) -> None:
        """The optimizer step's batch is known: kept for the checkpoints' record; after a resume,
        compared once with the batch of the run that wrote the checkpoint."""
        micro = self._micro
        micro.step_samples, micro.window_samples = micro.window_samples or None, 0
        self._checkpointing.check_batch(micro.step_samples)

    # --- inside a step -------------------------------------------------------------------
    def _clip_and_measure(self) -> None:
        """Clip when configured (the norm is the clipped one), else measure the norm on log
        steps only (same step on every rank: on sharded layouts a collective)."""
        clip = self._clip_norm
        if clip is None and not self.recorder.next_step_logs:
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # norms of the true gradients; step() does not unscale twice
        self.last_grad_norm = self.layout.clip_gradients(clip) if clip is not None else self.layout.global_grad_norm()

    def _refuse_after_stop(self) -> None:
        self._checkpointing.refuse_after_stop(self.step_count, self.recorder)

    def _mark(self, phase: str, step: int | None = None) -> None:
        if self.progress is not None:
            self.progress.mark(phase, step)

    # --- healing in place (slipstream run --heal; slipstream.resilience.heal) -------------------------------
    def _heal_or_raise(self, exc: BaseException) -> None:
        """Heal in place after a failed collective, or raise ``exc`` (diagnosed) when this run
        does not heal or ``exc`` is not a lost peer. After a heal the micro-step in hand is
        dropped: the state is the last snapshot's, and the loop goes on from there."""
        if self._healing is None or not is_collective_failure(exc):
            self._raise_diagnosed(exc)
        self._healing.heal(exc, failed_in=self.step_count + 1)
        self._dropped = True

    def _healed_step(self, exc: BaseException) -> StepResult:
        self._heal_or_raise(exc)
        self._dropped = False
        return StepResult(stepped=False, step=self.step_count, healed=True)

    def _forward_failed(self, exc: BaseException) -> bool:
        self._heal_or_raise(exc)
        return True

    def _raise_diagnosed(self, exc: BaseException) -> NoReturn:
        if self.progress is not None and is_collective_failure(exc):
            raise diagnose_hang(self.progress, exc, self.runtime.timeout_s, self.recorder.run_dir) from exc
        raise exc

    # --- checkpoint state ----------------------------------------------------------------
    def counters_state(self) -> dict[str, Any]:
        """Step counters, the fp16 scaler and the scheduler: the ``train`` checkpoint entry."""
        return {
            "step": self.step_count,
            "micro_step": self._micro.total,
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
        }

    def load_counters_state(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        self._micro.total = int(state["micro_step"])
        self._micro.index = 0
        self.recorder.step = self.step_count
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])


def _start_healing(run: Accelerated, healer: heal.Healer) -> None:
    """Arm healing in place for this run, or say in one line why not (the launcher's full restart
    stays); a replacement joins the survivors in healing.start, before the restore every rank then makes."""
    run._healing = healing.start(run, healer, run._micro)
    if run._healing is None:
        return
    run.healer = healer
    run.layout.model.sl_on_failure = run._forward_failed  # type: ignore[union-attr]
    healer.arm()


def _model_loss(output: Any) -> torch.Tensor:
    """The loss a model computed itself: ``output.loss``, or ``output["loss"]`` of a dict
    (a Hugging Face ``ModelOutput`` has both; it is set when the batch holds ``labels``).

    Example::

        _model_loss(model(input_ids=ids, labels=ids))   # tensor(4.85, grad_fn=...)
    """
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            f"train_step without loss_fn takes the loss from the model's output (output.loss), but the model "
            f"returned {_describe_loss(output)}; put the labels in the batch, or give train_step(inputs, "
            "target, loss_fn)"
        )
    return loss


def _describe_loss(value: Any) -> str:
    if value is None:
        return "None (a model called without labels computes no loss: put labels in the batch)"
    name = type(value).__name__
    if isinstance(value, Mapping):
        hint = " (pass outputs.loss)" if isinstance(value.get("loss"), torch.Tensor) else ", no loss among them"
        return f"a {name} with keys {list(value)}{hint}"
    return f"a {name} (pass outputs.loss)" if isinstance(getattr(value, "loss", None), torch.Tensor) else f"a {name}"


def _check_inputs(model: Any, optimizer: Any, scheduler: Any, extra_state: Any, config: TrainConfig,
                  plain: bool, healing: bool = False) -> None:
    """Every check that does not depend on the layout, once, before anything is built."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, DistributedDataParallel):
        raise ConfigError("model is already wrapped in DistributedDataParallel; pass the plain module")
    if not isinstance(optimizer, torch.optim.Optimizer) and not callable(optimizer):
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer or a factory params -> Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        foreign = foreign_parameters(optimizer, model)
        if foreign:
            raise ConfigError(f"the optimizer holds {foreign} parameter(s) that are not in the model")
        if not plain and scheduler is not None and hasattr(scheduler, "step"):
            raise ConfigError(
                "with dp_shard, tp or pp the optimizer is rebuilt over the sharded parameters, so a scheduler "
                "bound to the old one would not see it: pass scheduler=lambda optimizer: ... (a factory)"
            )
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        if dtype in dtypes:
            check_parameter_dtype(config, name)
    if extra_state and config.checkpoint.dir is None and not healing:
        # Healing in place keeps it in the in-memory snapshots without a checkpoint_dir: a heal that put
        # the model back but not the data's position would read other batches than the run it replays.
        raise ConfigError("extra_state is saved in checkpoints: set checkpoint_dir too")
    if config.checkpoint.snapshot_every_steps is not None and config.checkpoint.dir is None and not healing:
        raise ConfigError("snapshot_every_steps keeps in memory what checkpoints keep on disk, and a restarted "
                          "worker chooses between the two: set checkpoint_dir too")


def accelerate(
    model: nn.Module,
    optimizer: OptimizerArg,
    config: TrainConfig | None = None,
    *,
    scheduler: Any = None,
    extra_state: dict[str, Any] | None = None,
    tp_plan: dict[str, Any] | None = None,
    pp_split_points: list[str] | None = None,
    sinks: Sequence[Sink] = (),
    **options: Any,
) -> Accelerated:
    """Wrap ``model`` and ``optimizer`` for distributed training.

    ``options`` (flat names: ``precision="bf16"``), or a whole ``config`` (a
    :class:`TrainConfig`), are the script's settings; a ``SLIPSTREAM_*`` variable
    (set by ``slipstream run``'s flags, its run config or a job spec) wins over
    them, and rank 0 names each value it replaced in one line at start
    (:func:`slipstream.config.resolve`; docs/launcher.md, "Which value wins").
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
    evenly; see :mod:`slipstream.parallel.pipeline`). Both are ignored by the
    data-parallel layout, so one script runs under every layout.
    ``sinks`` (optional): your own metric sinks (objects with ``write(record)`` and
    ``close()``, see :class:`slipstream.metrics.sinks.Sink`); each receives every
    log step's record, beside the trackers ``log_to`` names.
    ``extra_state`` (optional): more objects with ``state_dict()``/``load_state_dict()``
    (a data sampler, say) saved in every checkpoint. With ``checkpoint_dir``
    set, the run resumes from the newest complete checkpoint there; read
    ``run.step_count`` and ``run.micro_step_count`` to continue the loop.

    Example::

        run = slipstream.accelerate(model, opt, precision="bf16", grad_clip_norm=1.0)
    """
    # An option given as None counts as not given: the environment's default stays.
    options = {key: value for key, value in options.items() if value is not None}
    if config is not None and options:
        raise ConfigError(f"give either config or keyword options, not both (got {', '.join(options)})")
    config, overrides = resolve(config if config is not None else options)  # slipstream run's settings win
    runtime = current()
    if runtime.is_main:
        for override in overrides:
            log.info(override.line(), extra=CONSOLE)
    adopt.mark_accelerate_called()  # under `slipstream run`, the options reach this loop
    # Healing in place goes back to the last in-memory snapshot: unless the user chose a cadence, it is
    # measured so that snapshots take under 1% of the step time (slipstream.checkpoint.cadence).
    healer = runtime.healer  # the healing collaborator (slipstream.resilience.heal), when the launcher supervises this rank
    snapshot_auto = healer is not None and config.checkpoint.snapshot_every_steps is None
    plain = config.is_plain_data_parallel(runtime.world_size)
    _check_inputs(model, optimizer, scheduler, extra_state, config, plain, healing=healer is not None)

    recorder = new_recorder(config, runtime)
    # Heartbeats also go to RUN_DIR/progress: on NCCL the launcher's hang report
    # (from flight-recorder dumps) adds where each rank's host code was.
    progress_dir = os.path.join(recorder.run_dir, "progress") if recorder.run_dir else None
    reporter = (ProgressReporter(runtime.rank, runtime.world_size, progress_dir=progress_dir)
                if runtime.world_size > 1 else None)
    micro = MicroSteps(config.numerics.accumulate_steps)
    context = ForwardContext(micro=micro, recorder=recorder, progress=reporter, device=runtime.device)
    try:
        layout: Layout = (
            DataParallelLayout(model, config, runtime, context) if plain
            else MeshLayout(model, config, runtime, context, tp_plan=tp_plan, pp_split_points=pp_split_points)
        )
        built = layout.optimizer_for(optimizer)
        if layout.sync is not None:
            layout.sync.attach_optimizer(built)  # before a checkpoint is restored into it
        built_scheduler = build_scheduler(scheduler, built)
        recorder.attach(layout.module, config, runtime.device, runtime.local_rank, extra_sinks=sinks)  # phase hooks, sinks
    except Exception:  # noqa: BLE001 - re-raised; a failed build or attach (a tracker's package missing, a
        # busy Prometheus port) leaves no open sinks or heartbeat thread
        recorder.close()
        if reporter is not None:
            reporter.close()
        raise
    if layout.sync is not None:
        recorder.sources.append(layout.sync.stats)
    run = Accelerated(layout, built, config, runtime, recorder, micro, reporter, scheduler=built_scheduler)
    if config.checkpoint.dir is not None or healer is not None:
        # Healing with no checkpoint_dir: a manager of in-memory snapshots only, which a heal goes back to.
        run.checkpoints = open_checkpoints(
            config, layout.checkpoint_state(built), CallbackState(run.counters_state, run.load_counters_state),
            extra_state or {}, layout.sync, snapshot_auto=snapshot_auto,
        )
    if healer is not None:
        _start_healing(run, healer)
        if run.healer is None and config.checkpoint.dir is None:  # cannot heal: its snapshots would serve nothing
            run.checkpoints.close()  # type: ignore[union-attr]
            run.checkpoints = None
    if run.checkpoints is not None:
        mgr = run.checkpoints
        mgr.describe_run = lambda: resume.describe(config, runtime.world_size, layout.dp_size, micro.step_samples)
        script_hyperparameters = resume.hyperparameters(built)  # before the restore puts the saved ones back
        step = mgr.restore_latest()
        if step:
            run.resumed_from_step = step
            if runtime.is_main:
                run._checkpointing.report_resume(mgr, step, script_hyperparameters, built, config.run.total_steps)
    return run
