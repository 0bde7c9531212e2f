"""Workers for the half-precision-parameter tests (spawned by tests.harness.run_ranks).

One spawn of the ranks trains the same small MLP under every strategy of
``sync.available()``, with fp32, bf16 and fp16 parameters, and returns each run's
losses: starting torch in a process costs seconds on the shared machine, so the
loop over strategies runs inside one pair of processes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.sync._workers import batch, mlp

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WIDTHS = [32, 64, 64, 8]


def train(strategy: str, dtype: torch.dtype, steps: int, **options) -> dict:
    """``steps`` steps of plain SGD on an MLP whose parameters are ``dtype``; losses and byte figures."""
    from slipstream import sync

    model = mlp(WIDTHS).to(dtype)
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
    if strategy.endswith("auto"):
        # A slow link instead of loopback's probe, the plan kept unverified and the
        # convergence gate off: auto compresses from step 3 (on loopback the tiny model's
        # communication is hidden, and it would choose plain all-reduce).
        from slipstream.network.link import Link
        from slipstream.sync import probe

        real = probe.probe_link
        probe.probe_link = lambda *a, **k: Link.measured(dist.get_world_size(), 2e-4, 2e6)
        try:
            state = sync.apply(strategy, ddp, observe_steps=1, verify_steps=0, min_retained=0.0, **options)
        finally:
            probe.probe_link = real
    elif strategy == "diloco":
        state = sync.apply(strategy, ddp, inner_steps=4, **options)  # outer steps within the run
    else:
        state = sync.apply(strategy, ddp, **options)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    losses = []
    try:
        for step in range(steps):
            x, y = batch(step, dist.get_rank(), 64, WIDTHS[0], WIDTHS[-1])
            loss = nn.functional.cross_entropy(ddp(x.to(dtype)).float(), y)
            loss.backward()
            state.observe_loss(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            state.after_optimizer_step()
            losses.append(float(loss.detach()))
        stats = state.stats()
        codec_state = state.state_dict().get("codecs", {})
    finally:
        state.close()
    dtypes = sorted({str(t.dtype) for c in codec_state.values() for part in ("residuals", "q")
                     for t in c.get(part, {}).values()})
    return {"losses": losses, "decision": stats.get("sync_decision"),
            "bytes_sent": stats.get("sync_bytes_sent"), "uncompressed": stats.get("sync_uncompressed_bytes"),
            "state_dtypes": dtypes}


def every_strategy(rank: int, world: int, steps: int, names: list[str] | None = None) -> dict:
    """{dtype: {strategy: train(...)}} for every strategy (or ``names``) and parameter dtype."""
    import slipstream
    from slipstream import sync

    slipstream.init()
    names = names or list(sync.available())
    out: dict = {}
    for dname, dtype in DTYPES.items():
        for name in names:
            out.setdefault(dname, {})[name] = train(name, dtype, steps)
    return out


def fp16_facade_scale(rank: int, world: int, strategy: str) -> dict:
    """accelerate() with fp16 and an error-feedback strategy: does the sync engine see the
    scaler's loss scale (the same device tensor, no copy), and does training stay finite?"""
    import slipstream

    slipstream.init()
    model = mlp(WIDTHS)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = slipstream.accelerate(model, opt, progress=False, run_dir=None, precision="fp16", sync=strategy)
    losses = []
    for step in range(3):
        x, y = batch(step, rank, 32, WIDTHS[0], WIDTHS[-1])
        loss = nn.functional.cross_entropy(run.model(x), y)
        run.backward(loss)
        run.step()
        losses.append(float(loss.detach()))
    sync = run.sync_state
    seen = sync._loss_scale() if sync._loss_scale is not None else None
    out = {"same_tensor": seen is run.scaler._scale, "losses": losses}
    run.finish()
    return out
