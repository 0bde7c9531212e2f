"""Worker functions of the DiLoCo tests (spawned by tests.harness.run_ranks, 2 ranks, gloo)."""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTHS = [16, 32, 32, 4]


def mlp(seed: int = 0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(WIDTHS[0], WIDTHS[1])]
    if batchnorm:
        layers.append(nn.BatchNorm1d(WIDTHS[1]))
    layers += [nn.Tanh(), nn.Linear(WIDTHS[1], WIDTHS[2]), nn.Tanh(), nn.Linear(WIDTHS[2], WIDTHS[3])]
    return nn.Sequential(*layers)


def batch(step: int, rank: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank its own data; labels from a fixed random linear teacher (a task that can be learnt)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, WIDTHS[0], generator=g)
    teacher = torch.randn(WIDTHS[0], WIDTHS[-1], generator=torch.Generator().manual_seed(12345))
    return x, (x @ teacher).argmax(dim=1)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_ranks(t: torch.Tensor) -> bool:
    lo, hi = t.double().clone(), t.double().clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def train(strategy: str, steps: int, *, opt_name: str = "sgd", lr: float = 0.1, start: int = 0, state=None,
          per_step=None, batchnorm: bool = False, **options):
    """``steps`` steps of the MLP under ``strategy``; returns (model, handle, losses, optimizer)."""
    from slipstream import sync

    model = mlp(batchnorm=batchnorm)
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets
    handle = sync.apply(strategy, ddp, **options)
    opt = (torch.optim.SGD(model.parameters(), lr=lr) if opt_name == "sgd"
           else torch.optim.Adam(model.parameters(), lr=lr))
    handle.attach_optimizer(opt)
    if state is not None:
        model.load_state_dict(state["model"])  # what the shared checkpoint holds (rank 0's), then ours
        opt.load_state_dict(state["opt"])
        handle.load_state_dict(state["sync"])
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, dist.get_rank())
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        handle.after_optimizer_step()
        losses.append(float(loss.detach()))
        if per_step is not None:
            per_step(step + 1, model, handle)
    return model, handle, losses, opt


def _check(out: dict, name: str, fn) -> None:
    started = time.perf_counter()
    try:
        out[name] = fn()
    except Exception:  # noqa: BLE001 - reported to the test
        out[name] = {"error": traceback.format_exc()}
    dist.barrier()
    out.setdefault("seconds", {})[name] = round(time.perf_counter() - started, 2)


def suite(rank: int, world: int, ckpt: str) -> dict:
    """Every check in one spawn (starting torch in two processes costs 10-40 s on the shared machine)."""
    import slipstream
    from slipstream import sync

    slipstream.init()
    torch.set_num_threads(1)
    out: dict = {}

    def local_gradients():
        # Inner steps: the gradient DDP leaves is this rank's own (not averaged, not scaled),
        # and the handle counts no byte sent.
        model = mlp()
        ref = mlp()
        ddp = DDP(model, bucket_cap_mb=0.001)
        handle = sync.apply("diloco", ddp, inner_steps=4)
        x, y = batch(0, rank)
        nn.functional.cross_entropy(ddp(x), y).backward()
        nn.functional.cross_entropy(ref(x), y).backward()
        diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
        s = handle.stats()
        bn = DDP(mlp(batchnorm=True))
        syncs_before = bn.will_sync_module_buffers()
        sync.apply("diloco", bn)
        return {"diff": diff, "bytes": s["sync_bytes_sent"], "total": s["sync_bytes_sent_total"],
                "steps": s["sync_steps"], "grads_differ": not same_on_ranks(next(model.parameters()).grad),
                "buffers_broadcast": [syncs_before, bn.will_sync_module_buffers()]}

    def averaging_is_sync_sgd():
        # H=1, outer lr 1, no momentum: parameter averaging at every step = synchronous SGD.
        a, _, _, _ = train("diloco", 6, inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
        b, _, _, _ = train("allreduce", 6)
        pa, pb = flat_params(a), flat_params(b)
        return {"rel": float((pa - pb).abs().max() / pb.abs().max())}

    def schedule():
        seen = []

        def look(step, model, handle):
            s = handle.stats()
            seen.append({"step": step, "same": same_on_ranks(flat_params(model)), "bytes": s["sync_bytes_sent"],
                         "mode": s["sync_mode"]})

        _, handle, _, _ = train("diloco", 8, inner_steps=4, per_step=look)
        s = handle.stats()
        return {"seen": seen, "total": s["sync_bytes_sent_total"], "outer_steps": s["sync_outer_steps"],
                "per_step_allreduce": s["sync_uncompressed_bytes"], "ratio": s["sync_compression_ratio"]}

    def fragments_and_codec():
        seen = []

        def look(step, model, handle):
            ps = [p.detach().reshape(-1) for p in model.parameters()]
            frags = [torch.cat([ps[i] for i in f]) for f in handle.fragments]
            seen.append({"step": step, "same": [same_on_ranks(f) for f in frags], "bytes": handle.last_bytes})

        _, handle, _, _ = train("diloco", 4, inner_steps=4, fragments=2, outer_codec="bf16", per_step=look)
        numel = [sum(handle.params[i].numel() for i in f) for f in handle.fragments]
        return {"seen": seen, "numel": numel, "phases": handle.phases}

    def resume_bitwise():
        # 10 steps with H=4 and Adam; against 6 steps, state saved, and 4 more in a fresh model.
        # The paper's Nesterov momentum: its buffers are part of the state that must resume.
        kw = dict(opt_name="adam", lr=0.01, inner_steps=4, batchnorm=True, outer_momentum=0.9)
        full, _, _, _ = train("diloco", 10, **kw)
        first, handle, _, opt = train("diloco", 6, **kw)
        # the shared checkpoint holds rank 0's model and optimizer: give every rank rank 0's
        shared = [{"model": first.state_dict(), "opt": opt.state_dict()}]
        dist.broadcast_object_list(shared, src=0)
        state = {**shared[0], "sync": handle.state_dict()}
        state = _round_trip(state)
        resumed, _, _, _ = train("diloco", 4, opt_name="adam", lr=0.01, start=6, state=state, inner_steps=4,
                                 batchnorm=True, outer_momentum=0.9)
        fresh, _, _, _ = train("diloco", 4, opt_name="adam", lr=0.01, start=6,
                               state={**shared[0], "sync": {**state["sync"], "inner_optimizer": None}},
                               inner_steps=4, batchnorm=True, outer_momentum=0.9)
        sd_full, sd_res = full.state_dict(), resumed.state_dict()
        return {"equal": all(torch.equal(sd_full[k], sd_res[k]) for k in sd_full),
                "without_inner_state_differs": not torch.equal(flat_params(full), flat_params(fresh))}

    def overlap():
        # H=4, overlap_steps=2, outer lr 1, no momentum: the all-reduce started at step 4 lands
        # at step 6, where the outer value is the ranks' mean of their step-4 parameters.
        seen, at_start = [], {}

        def look(step, model, handle):
            flat = flat_params(model)
            if step == 4:
                mean = flat.clone()
                dist.all_reduce(mean)
                at_start["mean"] = mean / dist.get_world_size()
            s = handle.stats()
            seen.append({"step": step, "same": same_on_ranks(flat), "bytes": s["sync_bytes_sent"],
                         "mode": s["sync_mode"], "in_flight": sorted(handle.pending)})
            if step == 6:
                at_start["err"] = float((flat - at_start["mean"]).abs().max() / at_start["mean"].abs().max())

        _, handle, _, _ = train("diloco", 8, inner_steps=4, overlap_steps=2, outer_lr=1.0, outer_momentum=0.0,
                                per_step=look)
        mixed = []
        train("diloco", 6, inner_steps=4, overlap_steps=2, overlap_mix=0.5,
              per_step=lambda step, model, h: mixed.append(same_on_ranks(flat_params(model))))
        return {"seen": seen, "err": at_start["err"], "outer_steps": handle.stats()["sync_outer_steps"],
                "mixed_same": mixed, "summary": handle.decision_summary()}

    def overlap_resume_bitwise():
        # A save while a fragment is in flight (started at 4, lands at 6; saved after 5): the
        # resumed run lands it at 6 from the saved, already averaged, pseudo-gradient.
        kw = dict(opt_name="adam", lr=0.01, inner_steps=4, overlap_steps=2, fragments=2, outer_codec="bf16")
        full, _, _, _ = train("diloco", 10, **kw)
        first, handle, _, opt = train("diloco", 5, **kw)
        in_flight = sorted(handle.pending)
        shared = [{"model": first.state_dict(), "opt": opt.state_dict()}]
        dist.broadcast_object_list(shared, src=0)
        state = _round_trip({**shared[0], "sync": handle.state_dict()})
        resumed, _, _, _ = train("diloco", 5, start=5, state=state, **kw)
        sd_full, sd_res = full.state_dict(), resumed.state_dict()
        return {"equal": all(torch.equal(sd_full[k], sd_res[k]) for k in sd_full), "in_flight": in_flight,
                "saved": sorted(state["sync"]["in_flight"])}

    def loss_falls():
        _, _, losses, _ = train("diloco", 40, opt_name="sgd", lr=0.2, inner_steps=5, outer_momentum=0.9)  # the paper's Nesterov path
        return {"first": sum(losses[:5]) / 5, "last": sum(losses[-5:]) / 5}

    for name, fn in [("local_gradients", local_gradients), ("averaging_is_sync_sgd", averaging_is_sync_sgd),
                     ("schedule", schedule), ("fragments_and_codec", fragments_and_codec),
                     ("resume_bitwise", resume_bitwise), ("overlap", overlap),
                     ("overlap_resume_bitwise", overlap_resume_bitwise), ("loss_falls", loss_falls),
                     ("accelerate_resume", lambda: accelerate_resume(ckpt))]:
        _check(out, name, fn)
    return out


def _round_trip(state: dict) -> dict:
    """Through torch.save/load, as the checkpoint's per-rank file goes."""
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _accelerate(ckpt: str, steps: int, stop_after: int | None = None) -> dict:
    """slipstream.accelerate with checkpoints every 2 steps, H=3, AdamW, BatchNorm. With
    ``stop_after``: the run is dropped after that many steps (what a kill leaves: the
    checkpoints on disk; the lease and groups are let go, as a dead process's are)."""
    import slipstream

    model = mlp(batchnorm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    run = slipstream.accelerate(model, opt, sync="diloco", sync_options={"inner_steps": 3}, progress=False,
                                run_dir=None, checkpoint_dir=ckpt, checkpoint_every_steps=2)
    start = run.step_count
    for step in range(start, steps if stop_after is None else stop_after):
        x, y = batch(step, run.dp_rank)
        run.backward(nn.functional.cross_entropy(run.model(x), y))
        run.step()
    if stop_after is not None:
        run.checkpoints.close()
        if run.progress is not None:
            run.progress.close()
        run.recorder.close()
        return {"stopped_at": run.step_count}
    run.finish()
    from slipstream.train.bucket_order import is_fixed

    return {"params": flat_params(model), "resumed_from": start, "bucket_order_fixed": is_fixed(run.model)}


def accelerate_resume(ckpt: str) -> dict:
    """8 steps whole, against 5 steps dropped (checkpoint of step 4 left) and a resumed run."""
    whole = _accelerate(os.path.join(ckpt, "whole"), 8)
    _accelerate(os.path.join(ckpt, "killed"), 8, stop_after=5)
    resumed = _accelerate(os.path.join(ckpt, "killed"), 8)
    return {"equal": torch.equal(whole["params"], resumed["params"]), "resumed_from": resumed["resumed_from"],
            "whole_from": whole["resumed_from"], "replicas_differ": not same_on_ranks(whole["params"]),
            "bucket_order_fixed": whole["bucket_order_fixed"]}
