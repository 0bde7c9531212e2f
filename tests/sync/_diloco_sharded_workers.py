"""Worker functions of the sharded DiLoCo tests: 4 ranks on gloo, 2 replicas x dp_shard 2.

Spawned once by tests/sync/test_diloco_sharded.py (tests.harness.run_ranks); every check runs
through ``slipstream.accelerate`` and reports plain data (no assertion here).
"""

from __future__ import annotations

import inspect
import os
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

from tests.sync._diloco_workers import batch

REPLICAS = {"dp_replicate": 2, "dp_shard": 2}


class Net(nn.Module):
    """Two layers (each its own FSDP2 unit, as the GPT's blocks are), optional BatchNorm, a head."""

    def __init__(self, batchnorm: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(16, 32), nn.Tanh()),
                                     nn.Sequential(nn.Linear(32, 32), nn.Tanh())])
        self.norm = nn.BatchNorm1d(32) if batchnorm else nn.Identity()
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def start(run_dir: str, *, optimizer: str = "sgd", lr: float = 0.1, batchnorm: bool = False, seed: int = 0,
          **options):
    import slipstream

    model = Net(batchnorm, seed)
    factory = ((lambda ps: torch.optim.SGD(ps, lr=lr)) if optimizer == "sgd"
               else (lambda ps: torch.optim.AdamW(ps, lr=lr)))
    options = {"progress": False, "run_dir": run_dir, "log_every_steps": 1000, **options}
    return slipstream.accelerate(model, factory, **options)


def train(run, steps: int, per_step=None) -> None:
    for step in range(run.step_count, steps):
        x, y = batch(step, run.dp_rank)
        run.backward(nn.functional.cross_entropy(run.model(x), y))
        run.step()
        if per_step is not None:
            per_step(run.step_count)


def full(run) -> torch.Tensor:
    """The whole model (parameters and buffers) as this rank's replica holds it (a collective)."""
    return torch.cat([t.reshape(-1).double() for _, t in sorted(run.unwrapped_state_dict().items())])


def local_shards(run, indices=None) -> torch.Tensor:
    params = list(run.module.parameters())
    chosen = params if indices is None else [params[i] for i in indices]
    return torch.cat([p.to_local().detach().reshape(-1).double() for p in chosen])


def same_in(group, t: torch.Tensor) -> bool:
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(lo, hi))


class Tap:
    """Records which ranks each torch.distributed collective ran over, while ``on``."""

    NAMES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
             "reduce_scatter_tensor", "broadcast", "all_gather", "reduce_scatter", "all_to_all_single", "reduce",
             "gather", "scatter", "send", "recv", "isend", "irecv", "barrier", "all_gather_object",
             "broadcast_object_list")

    def __init__(self) -> None:
        self.on = False
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self._saved = {}
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        sig = inspect.signature(fn)

        def tapped(*args, **kwargs):
            if self.on:
                group = sig.bind_partial(*args, **kwargs).arguments.get("group")
                ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
                self.calls.append((name, ranks))
            return fn(*args, **kwargs)

        return tapped

    def take(self) -> list[tuple[str, tuple[int, ...]]]:
        out, self.calls = self.calls, []
        return out

    def remove(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _check(out: dict, name: str, fn) -> None:
    started = time.perf_counter()
    try:
        out[name] = fn()
    except Exception:  # noqa: BLE001 - reported to the test
        out[name] = {"error": traceback.format_exc()}
    dist.barrier()
    out.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 2)


def suite(rank: int, world: int, tmp: str) -> dict:
    """Every check in one spawn (starting torch in four processes is most of the cost)."""
    import slipstream

    slipstream.init()
    out: dict = {}
    runs = os.path.join(tmp, "runs")

    def averaging_is_sync_sgd():
        # H=1, outer lr 1, no momentum, inner SGD: every step averages the replicas' new
        # parameters, which is the synchronous step on the mean gradient of all four ranks.
        a = start(runs, sync="diloco", sync_options={"inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0},
                  **REPLICAS)
        train(a, 5)
        b = start(runs, sync="allreduce", **REPLICAS)  # HSDP: all-reduce across replicas at every step
        train(b, 5)
        c = start(runs, sync="allreduce")  # plain DDP over the four ranks
        train(c, 5)
        pa, pb, pc = full(a), full(b), full(c)
        handle = a.sync_state
        result = {"rel_hsdp": float((pa - pb).abs().max() / pb.abs().max()),
                  "rel_ddp": float((pa - pc).abs().max() / pc.abs().max()),
                  "outer_steps": handle.stats()["sync_outer_steps"], "summary": handle.decision_summary(),
                  "meshes": sorted({p.device_mesh.mesh_dim_names for p in a.module.parameters()}),
                  "hsdp_meshes": sorted({p.device_mesh.mesh_dim_names for p in b.module.parameters()})}
        for run in (a, b, c):
            run.finish()
        return result

    def schedule_and_traffic():
        # H=3 with AdamW and clipping: which groups every step's collectives ran over, and
        # whether the replicas hold the same shards after it.
        run = start(runs, optimizer="adamw", lr=0.01, sync="diloco", sync_options={"inner_steps": 3},
                    grad_clip_norm=0.5, **REPLICAS)
        dims = run.layout.dims
        replica_group = dims.mesh.get_group("dp_replicate")
        replica_ranks = tuple(dist.get_process_group_ranks(replica_group))
        shard_ranks = tuple(dist.get_process_group_ranks(dims.mesh.get_group("dp_shard")))
        norms = []
        seen = []
        tap = Tap()

        def look(step):
            tap.on = False
            s = run.sync_state.stats()
            norms.append(float(run.last_grad_norm))
            seen.append({"step": step, "calls": tap.take(), "same": same_in(replica_group, local_shards(run)),
                         "bytes": s["sync_bytes_sent"], "mode": s["sync_mode"]})
            tap.on = True

        tap.on = True
        try:
            train(run, 6, per_step=look)
        finally:
            tap.on = False
            tap.remove()
        # The step-1 norm, from an unsharded copy on this replica's two batches (FSDP2 averages them).
        ref = Net()
        replica = dims.mesh.get_local_rank("dp_replicate")
        for r in range(2):
            x, y = batch(0, replica * 2 + r)
            (nn.functional.cross_entropy(ref(x), y) / 2).backward()
        ref_norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
        s = run.sync_state.stats()
        result = {"seen": seen, "replica_ranks": replica_ranks, "shard_ranks": shard_ranks, "norms": norms,
                  "ref_norm": ref_norm, "total": s["sync_bytes_sent_total"], "outer_steps": s["sync_outer_steps"],
                  "per_step": s["sync_uncompressed_bytes"], "local_numel": local_shards(run).numel()}
        run.finish()
        return result

    def hsdp_control():
        # The tap sees cross-replica traffic where there is some: HSDP all-reduces across replicas.
        run = start(runs, sync="allreduce", **REPLICAS)
        tap = Tap()
        tap.on = True
        try:
            train(run, 1)
        finally:
            tap.on = False
            tap.remove()
        calls = tap.take()
        run.finish()
        return {"calls": calls}

    def fragments_and_codec():
        # Streaming, 2 fragments, bf16 on the wire: fragment 0 at step 2, fragment 1 at step 4.
        run = start(runs, sync="diloco", sync_options={"inner_steps": 4, "fragments": 2, "outer_codec": "bf16"},
                    **REPLICAS)
        group = run.layout.dims.mesh.get_group("dp_replicate")
        handle = run.sync_state
        seen = []

        def look(step):
            seen.append({"step": step, "same": [same_in(group, local_shards(run, f)) for f in handle.fragments],
                         "bytes": handle.last_bytes})

        train(run, 4, per_step=look)
        numel = [sum(handle.params[i].to_local().numel() for i in f) for f in handle.fragments]
        result = {"seen": seen, "numel": numel, "phases": handle.phases}
        run.finish()
        return result

    def replicas_start_equal():
        # Every rank seeds its model differently: FSDP2 broadcasts nothing, so the strategy
        # gives every replica the first one's parameters and buffers before the first step.
        run = start(runs, seed=100 + rank, batchnorm=True, sync="diloco", **REPLICAS)
        group = run.layout.dims.mesh.get_group("dp_replicate")
        buffers = torch.cat([b.reshape(-1).double() for b in run.module.buffers() if b.is_floating_point()])
        result = {"params": same_in(group, local_shards(run)), "buffers": same_in(group, buffers),
                  "outer_is_local": all(torch.equal(o, p.to_local()) for o, p in
                                        zip(run.sync_state.outer, run.module.parameters()))}
        run.finish()
        return result

    for name, fn in [("averaging_is_sync_sgd", averaging_is_sync_sgd), ("schedule_and_traffic", schedule_and_traffic),
                     ("hsdp_control", hsdp_control), ("fragments_and_codec", fragments_and_codec),
                     ("replicas_start_equal", replicas_start_equal), ("one_replica", lambda: one_replica(runs, 4)),
                     ("accelerate_resume", lambda: accelerate_resume(tmp))]:
        _check(out, name, fn)
    return out


def one_replica(runs: str, dp_shard: int) -> dict:
    """dp_shard over every rank: one replica, nothing to join: plain FSDP2 (bitwise), said once in the log."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("slipstream.train.layout_mesh")
    logger.addHandler(handler)  # the line is a console record: shown at the default level
    try:
        a = start(runs, sync="diloco", sync_options={"inner_steps": 2}, dp_shard=dp_shard)
    finally:
        logger.removeHandler(handler)
    train(a, 3)
    b = start(runs, sync="allreduce", dp_shard=dp_shard)
    train(b, 3)
    result = {"equal": bool(torch.equal(full(a), full(b))), "sync": a.sync_state is None,
              "layout": a.describe_layout(), "log": lines}
    a.finish()
    b.finish()
    return result


def two_ranks(rank: int, world: int, tmp: str) -> dict:
    """The 2-rank form: dp_shard=2 alone is one replica."""
    import slipstream

    slipstream.init()
    out: dict = {}
    _check(out, "one_replica", lambda: one_replica(os.path.join(tmp, "runs"), 2))
    return out


def _resumable(ckpt: str, steps: int, stop_after: int | None = None) -> dict:
    """AdamW, BatchNorm, H=3, a checkpoint every 2 steps. With ``stop_after`` the run is
    dropped after that many steps (what a kill leaves: the checkpoints on disk)."""
    run = start(ckpt + "-run", optimizer="adamw", lr=0.01, batchnorm=True, sync="diloco",
                sync_options={"inner_steps": 3}, checkpoint_dir=ckpt, checkpoint_every_steps=2, **REPLICAS)
    begun = run.step_count
    group = run.layout.dims.mesh.get_group("dp_replicate")
    differ_at_start = not same_in(group, local_shards(run))
    train(run, steps if stop_after is None else stop_after)
    if stop_after is not None:
        run.checkpoints.close()
        run.recorder.close()
        return {"stopped_at": run.step_count}
    state = full(run)
    differ = not same_in(group, state)
    run.finish()
    return {"state": state, "resumed_from": begun, "replicas_differ": differ, "differ_at_start": differ_at_start}


def accelerate_resume(tmp: str) -> dict:
    """8 steps whole, against 5 steps dropped (checkpoint of step 4 left) and a resumed run."""
    whole = _resumable(os.path.join(tmp, "whole"), 8)
    _resumable(os.path.join(tmp, "killed"), 8, stop_after=5)
    resumed = _resumable(os.path.join(tmp, "killed"), 8)
    return {"equal": bool(torch.equal(whole["state"], resumed["state"])), "resumed_from": resumed["resumed_from"],
            "whole_from": whole["resumed_from"], "replicas_differ": whole["replicas_differ"],
            "differ_at_resume": resumed["differ_at_start"]}
