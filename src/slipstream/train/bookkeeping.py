"""What a run keeps besides its layout: the metrics recorder and the checkpoint registry.

Example::

    recorder = new_recorder(config, runtime)      # a collective: rank 0 picks the run directory
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ..checkpoint import CheckpointManager
from ..checkpoint.states import CallbackState, ModelOptimizerState, RNGState
from ..config import TrainConfig
from ..metrics import StepRecorder
from ..process.runtime import Runtime
from ..resilience import heal
from ..sync import SyncHandle


def agree_run_dir(config: TrainConfig, runtime: Runtime) -> str:
    """Every rank writes under the same run directory; rank 0 chooses it (a collective)."""
    chosen = [config.run.dir or os.environ.get("SLIPSTREAM_RUN_DIR")]
    if chosen[0] is None and runtime.is_main:
        chosen[0] = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if heal.on_fake_group() and chosen[0] is not None:
        return chosen[0]  # a replacement (slipstream run --heal, which sets the directory): no peer to ask yet
    if runtime.world_size > 1:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]  # type: ignore[return-value]


def new_recorder(config: TrainConfig, runtime: Runtime) -> StepRecorder:
    """The run's metrics recorder, writing under the run directory every rank agreed on."""
    return StepRecorder(
        rank=runtime.rank,
        world_size=runtime.world_size,
        run_dir=agree_run_dir(config, runtime),
        log_every_steps=config.run.log_every_steps,
        total_steps=config.run.total_steps,
        progress=config.run.progress,
    )


def open_checkpoints(
    config: TrainConfig,
    model_optimizer: ModelOptimizerState,
    counters: CallbackState,
    extra_state: Mapping[str, Any],
    sync: SyncHandle | None,
    snapshot_auto: bool = False,
) -> CheckpointManager:
    """The run's checkpoint registry: model and optimizer, the step counters (with the
    scaler and scheduler), ``extra_state``, and per rank the RNG streams and the sync
    strategy's state. Call ``restore_latest()`` on it to resume. ``snapshot_auto``: in-memory snapshots
    at a measured cadence when ``snapshot_every_steps`` is not set (healing in place); with no
    ``checkpoint_dir``, they are all the manager keeps."""
    ckpt = config.checkpoint
    # CheckpointConfig's fields are the manager's keywords (``dir`` its first argument): a setting added to
    # the section reaches the manager without a copy here (tests/train/test_bookkeeping.py holds them equal).
    settings = {f.name: getattr(ckpt, f.name) for f in dataclasses.fields(ckpt) if f.name != "dir"}
    mgr = CheckpointManager(ckpt.dir, **settings, snapshot_auto=snapshot_auto)  # type: ignore[arg-type]
    if mgr.snapshots is not None and sync is not None:
        mgr.snapshots.cadence.align_to(sync.steps_between_syncs)  # a heal's snapshot: one every rank holds
    mgr.register("model_optimizer", model_optimizer)
    mgr.register("train", counters)
    for name, obj in extra_state.items():
        mgr.register(f"extra.{name}", obj)
    mgr.register("rng", RNGState(), per_rank=True)
    if sync is not None:
        mgr.register("sync", sync, per_rank=True)
    return mgr
