"""Spawned worker of tests/sync/test_collective_rule.py: every strategy, a re-probe, a
guard check and a checkpoint round trip under :class:`StrictCollectives`."""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

TIMEOUT_S = 123.0


def _train(strategy: str, steps: int, probe_at: int | None = None, **options) -> None:
    from slipstream import sync
    from tests.sync._workers import batch, mlp

    widths = [32, 64, 64, 8]
    model = mlp(widths)
    ddp = DDP(model, bucket_cap_mb=0.005)
    state = sync.apply(strategy, ddp, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        if probe_at is not None and step == probe_at:
            state.request_probe()
        x, y = batch(step, dist.get_rank(), 16, widths[0], widths[-1])
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        if hasattr(state, "observe_loss"):
            state.observe_loss(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    state.stats()
    if hasattr(state, "close"):
        state.close()


def rule(rank: int, world: int, port: int, out_path: str, local_world: int) -> None:
    import slipstream
    from slipstream.process import gloo_exit
    from tests.sync.strict_collectives import StrictCollectives, group_timeout_of

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
        LOCAL_WORLD_SIZE=str(local_world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        SLIPSTREAM_COLLECTIVE_TIMEOUT_S=str(TIMEOUT_S),
    )
    torch.set_num_threads(1)
    rt = slipstream.init(backend="gloo")
    gloo_exit.install()
    strict = StrictCollectives(rt.device, TIMEOUT_S).install()
    res: dict = {"errors": {}}
    guard = {"check_every_steps": 2}
    runs = [
        ("bf16", {}), ("fp16", {}), ("powersgd", {"rank": 2, **guard}), ("topk", {"density": 0.1, **guard}),
        ("sign", guard), ("hierarchical", {}), ("hierarchical+powersgd", {"rank": 2, **guard}),
        ("hierarchical+sign", guard), ("auto", {"observe_steps": 2, "verify_steps": 2}),
        ("hierarchical+auto", {"observe_steps": 2, "verify_steps": 2}),
    ]
    for name, options in runs:
        try:
            _train(name, 10, probe_at=6, **options)
        except Exception:
            res["errors"][name] = traceback.format_exc()
    try:
        from slipstream.checkpoint.manager import CheckpointManager

        folder = os.path.join(tempfile.gettempdir(), f"strict_ckpt_{port}")
        model = nn.Linear(4, 4)
        manager = CheckpointManager(folder, every_steps=1, async_save=True, handle_sigterm=False)
        manager.register("model", model)
        manager.save(1)
        manager.wait()
        res["restored_step"] = manager.restore_latest()
        # Every group of the run, read before close() destroys the manager's own two.
        groups = list(dist.distributed_c10d._world.pg_map)
        manager.close()
    except Exception:
        res["errors"]["checkpoint"] = traceback.format_exc()
        groups = list(dist.distributed_c10d._world.pg_map)
    strict.uninstall()
    res["group_timeouts_s"] = sorted({group_timeout_of(g).total_seconds() for g in groups})
    res["groups"] = len(groups)
    res["violations"] = strict.violations[:20]
    res["violation_count"] = len(strict.violations)
    res["host_calls"] = sum(1 for c in strict.calls if c[1] == "host")
    res["data_calls"] = sum(1 for c in strict.calls if c[1] == "data")
    # Tensors per group kind and placement ("data device", "host host", "data untold"...).
    res["placements"] = dict(Counter(f"{c[1]} {c[4]}" for c in strict.calls))
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)
    slipstream.shutdown()
