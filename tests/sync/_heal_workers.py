"""Rank workers of tests/sync/test_heal_rejoin.py: a sync strategy's groups and state across a heal in place.

Each rank forms its default group through :class:`slipstream.resilience.heal.Healer` (a real TCPStore), trains
an uninterrupted reference, then the same run again with a heal after step ``SNAP``: the state of
that step is kept (as a snapshot keeps it), one more step is taken (the work a heal undoes), every
rank leaves the group and joins the next generation as ``train.healing.InPlaceHealing.heal`` and the data
parallel layout do (``Healer.leave`` -> DDP and ``SyncHandle.leave`` -> ``Healer.rejoin`` -> DDP and
``SyncHandle.rejoined`` -> the bucket-order fix), loads the kept state, and trains to the end.
"""

from __future__ import annotations

import datetime
import io
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS, SNAP = 8, 5
WIDTHS = [16, 64, 64, 4]


def _copy(state):
    """A deep copy through bytes, as a snapshot is: nothing shared with the live objects."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (8,), generator=g)


def _build(strategy: str, options: dict):
    from slipstream import sync
    from slipstream.train.bucket_order import fix_bucket_order

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS, WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets: the ordering thread's jobs in turn
    if sync.describe(strategy).fixes_bucket_order:
        fix_bucket_order(ddp)  # as the data-parallel layout does
    handle = sync.apply(strategy, ddp, **options)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    handle.attach_optimizer(opt)
    return model, ddp, handle, opt


def _step(ddp, handle, opt, step: int) -> None:
    x, y = _batch(step, dist.get_rank())
    loss = nn.functional.cross_entropy(ddp(x), y)
    handle.observe_loss(loss.detach())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    handle.after_optimizer_step()


def _groups_now(handle) -> dict:
    """Where the handle's groups are: each must be a live group of the current generation."""
    from slipstream.sync import topology
    from slipstream.sync.diloco import DiLoCo

    live = set(dist.distributed_c10d._world.pg_map)
    if isinstance(handle, DiLoCo):
        return {"live": handle.group in live and handle.wire.group in live,
                "default": handle.group is dist.group.WORLD}
    g = topology.groups()
    wires = [w for r in handle._reducers() for w in ([r.wire] if hasattr(r, "wire") else [r.intra, r.inter])]
    return {"live": all(w.group in live for w in wires) and handle.control.group in live,
            "cached": all(w.group in (g.flat, g.intra, g.inter) for w in wires) and handle.control.group is g.control,
            "control_sum": handle.control.agree([1.0])[0]}


def _case(healer, strategy: str, options: dict) -> dict:
    from slipstream.train.bucket_order import fix_bucket_order_again

    model, ddp, handle, opt = _build(strategy, options)
    for s in range(STEPS):
        _step(ddp, handle, opt, s)
    reference = [p.detach().clone() for p in model.parameters()]
    reference_state = _copy(handle.state_dict())
    handle.close()

    model, ddp, handle, opt = _build(strategy, options)
    for s in range(SNAP):
        _step(ddp, handle, opt, s)
    kept = _copy({"model": model.state_dict(), "opt": opt.state_dict(), "sync": handle.state_dict()})
    _step(ddp, handle, opt, SNAP)  # undone by the heal
    # The heal, in the order InPlaceHealing.heal (train/healing.py) and DataParallelLayout.leave/rejoined take.
    healer.leave()
    ddp._update_process_group(dist.group.WORLD)
    handle.leave()
    healer.rejoin()
    ddp._update_process_group(dist.group.WORLD)
    handle.rejoined()
    from slipstream import sync

    if sync.describe(strategy).fixes_bucket_order:
        fix_bucket_order_again(ddp)
    model.load_state_dict(kept["model"])
    opt.load_state_dict(kept["opt"])
    handle.load_state_dict(kept["sync"])
    groups = _groups_now(handle)
    if getattr(handle, "auto", None) is not None:  # every rank decides from the kept link, not a new probe
        from slipstream.sync.probe import link_state

        groups["link_kept"] = link_state(handle.auto.link) == kept["sync"]["link"]
    for s in range(SNAP, STEPS):
        _step(ddp, handle, opt, s)
    got_state = _copy(handle.state_dict())
    handle.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return {
        "same_on_ranks": bool(torch.equal(lo, hi)),
        "mode": got_state.get("mode"),
        "bitwise": all(torch.equal(a, b) for a, b in zip(model.parameters(), reference)),
        "state_equal": _tree_equal(got_state, reference_state),
        "decision": handle.decision_summary(),
        "generation": healer.generation,
        **groups,
    }


def _tree_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        # bytes sent count the heal's redone step, and auto's link is each build's own probe
        # (checked against the kept one in _case); everything else must match
        skip = {"bytes_sent_total", "link"}
        keys = set(a) - skip
        return isinstance(b, dict) and keys == set(b) - skip and all(_tree_equal(a[k], b[k]) for k in keys)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_tree_equal(x, y) for x, y in zip(a, b))
    return a == b


def heal_cases(rank: int, world: int, store_port: int, cases: list) -> dict:
    """Run each ``(label, strategy, options, two_nodes)`` case; two_nodes: 2 nodes of 1 rank."""
    from slipstream.resilience import heal
    from slipstream.sync import auto as engine_auto

    store = dist.TCPStore("127.0.0.1", store_port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    healer = heal.Healer(store, "test", rank, world, "gloo", datetime.timedelta(seconds=60), join_timeout_s=60)
    healer.form()
    real_decide = engine_auto.decide
    out = {}
    for label, strategy, options, two_nodes in cases:
        forced = options.pop("force_codec", None)
        if forced is not None:  # auto's plan forced (its timings are not the same run to run)
            def decide(buckets, *a, _codec=forced, **k):
                d = real_decide(buckets, *a, **k)
                d.choices = {b.index: _codec for b in buckets}
                return d
            engine_auto.decide = decide
        saved = {k: os.environ[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        if two_nodes:
            os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        try:
            out[label] = _case(healer, strategy, options)
        finally:
            os.environ.update(saved)
            engine_auto.decide = real_decide
    return out
