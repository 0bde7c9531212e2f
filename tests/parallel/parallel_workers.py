"""What each rank runs in tests/parallel, and the single-process reference they are compared with.

Every layout trains the GPT of examples/train_gpt.py (tiny) on the same global
batch per step: rows are split over the data-parallel ranks by ``run.dp_rank``,
and ranks of one TP group or pipeline read the same rows. So every layout
computes the same mathematical step as one process on the whole batch.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
GLOBAL_BATCH, CONTEXT, DIM, LAYERS, HEADS, LR = 8, 16, 32, 4, 4, 1e-2


def example():
    spec = importlib.util.spec_from_file_location("train_gpt_example", REPO / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_gpt(ex, heads: int = HEADS, dim: int = DIM):
    torch.manual_seed(0)
    return ex.GPT(dim=dim, layers=LAYERS, heads=heads, context=CONTEXT)


def global_batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH, CONTEXT + 1), generator=g)  # 64 symbols: learnable statistics
    return tokens[:, :-1], tokens[:, 1:]


def optimizer_factory(params, **impl):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, **impl)


def sgd_factory(params, **impl):
    # For clipping tests: Adam is nearly blind to a gradient's scale, SGD is not.
    return torch.optim.SGD(params, lr=0.5, **impl)


IMPLEMENTATIONS = {
    None: {},                          # torch's default: foreach on a GPU, and here (tests/gpu_defaults.py)
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for-loop": {"foreach": False},    # the CPU's own default, asked for
}
"""A layout's ``optimizer_impl``: the optimizer implementation it trains with."""


def reference(steps: int, grad_clip_norm: float | None = None,
              grad_norms: list[float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain PyTorch: the losses and final weights every layout must reproduce
    (AdamW; SGD when clipping). ``grad_norms``, if given, receives each step's gradient norm
    before clipping."""
    ex = example()
    model = make_gpt(ex)
    opt = (optimizer_factory if grad_clip_norm is None else sgd_factory)(model.parameters())
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        loss = ex.loss_fn(model(x), y)
        loss.backward()
        if grad_norms is not None:
            grad_norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        if grad_clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(layout: dict, steps: int, checkpoint_dir: str | None = None, every: int | None = None):
    """Train ``steps`` optimizer steps in ``layout`` (accelerate options); returns
    (dp_rank, dp_size, losses of the steps run here, full state dict, run.step at start)."""
    import slipstream

    ex = example()
    model = make_gpt(ex, heads=layout.pop("heads", HEADS))
    base = sgd_factory if layout.get("grad_clip_norm") is not None else optimizer_factory
    impl = IMPLEMENTATIONS[layout.pop("optimizer_impl", None)]

    def factory(params):
        return base(params, **impl)

    if layout.pop("optimizer_object", False):
        factory = factory(model.parameters())  # an optimizer, rebuilt by accelerate() over the new parameters
    run = slipstream.accelerate(
        model, factory, tp_plan=ex.TP_PLAN, progress=False, profile=False, log_every_steps=1,
        checkpoint_dir=checkpoint_dir, checkpoint_every_steps=every, **layout,
    )
    start = run.step_count
    losses = []
    per_rank = GLOBAL_BATCH // run.dp_size
    while run.step_count < steps:
        x, y = global_batch(run.step_count)
        rows = slice(run.dp_rank * per_rank, (run.dp_rank + 1) * per_rank)
        losses.append(float(run.train_step(x[rows], y[rows], ex.loss_fn)))
    state = run.unwrapped_state_dict()
    params = list(run.module.parameters())
    meshes = {(tuple(p.device_mesh.mesh.flatten().tolist()), p.device_mesh.mesh_dim_names)
              for p in params if hasattr(p, "device_mesh")}
    run.finish()
    norm = None if run.last_grad_norm is None else float(run.last_grad_norm)  # the metrics' grad_norm, last step
    return {"dp_rank": run.dp_rank, "dp_size": run.dp_size, "losses": losses, "state": state, "start": start,
            "grad_norm": norm, "plain_params": sum(not hasattr(p, "device_mesh") for p in params),
            "meshes": len(meshes)}


def layouts_worker(rank: int, world: int, layouts: list[dict], steps: int, run_dir: str) -> list[dict]:
    """Several layouts one after the other in one process group (one spawn, less start-up time)."""
    import slipstream

    os.environ["SLIPSTREAM_RUN_DIR"] = run_dir
    slipstream.init()
    out = [train(dict(layout), steps) for layout in layouts]
    slipstream.shutdown()
    return out


def checkpoint_worker(rank: int, world: int, chain: list[dict], steps: list[int], ckpt: str, run_dir: str) -> list[dict]:
    """Train in chain[0] and checkpoint; then resume in each later layout from the newest checkpoint."""
    import slipstream

    os.environ["SLIPSTREAM_RUN_DIR"] = run_dir
    slipstream.init()
    out = [train(dict(layout), n, checkpoint_dir=ckpt, every=1) for layout, n in zip(chain, steps)]
    slipstream.shutdown()
    return out


def global_losses(results: list[dict]) -> list[float]:
    """Mean over the data-parallel ranks (equal shares of the global batch) of each step's loss."""
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], r["losses"])
    assert len(by_dp) == results[0]["dp_size"], by_dp.keys()
    per_step = list(zip(*by_dp.values()))
    return [sum(v) / len(v) for v in per_step]


def errors_worker(rank: int, world: int, run_dir: str) -> list[str]:
    """Misconfigurations that can only be seen with the model or the batch: their messages."""
    import slipstream
    from slipstream import ConfigError

    os.environ["SLIPSTREAM_RUN_DIR"] = run_dir
    slipstream.init()
    ex = example()
    messages = []
    try:  # 3 heads cannot be split over 2 TP ranks (the q width 48 could)
        slipstream.accelerate(ex.GPT(dim=48, layers=2, heads=3, context=CONTEXT), optimizer_factory,
                              tp=2, tp_plan=ex.TP_PLAN, progress=False)
    except ConfigError as exc:
        messages.append(str(exc))
    run = slipstream.accelerate(make_gpt(ex), optimizer_factory, pp=2, pp_microbatches=3, progress=False)
    x, y = global_batch(0)
    try:
        run.train_step(x, y, ex.loss_fn)
    except ConfigError as exc:
        messages.append(str(exc))
    run.finish()
    try:  # an optimizer that already stepped cannot be moved onto sharded parameters
        model = make_gpt(ex)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ex.loss_fn(model(x), y).backward()
        opt.step()
        slipstream.accelerate(model, opt, dp_shard=2, progress=False)
    except ConfigError as exc:
        messages.append(str(exc))
    slipstream.shutdown()
    return messages


def collectives_worker(rank: int, world: int, layouts: list[dict], root: str) -> list[dict]:
    """Each layout through a whole life under :class:`CollectiveLog`: 2 steps saving a
    checkpoint at each, a second ``accelerate()`` resuming there for a 3rd step, and the
    full state dict gathered. Returns per layout the collectives on the training mesh's
    groups and the default group (what carries device tensors), and on the others."""
    import slipstream
    from tests.parallel.collective_log import CollectiveLog

    os.environ["SLIPSTREAM_RUN_DIR"] = os.path.join(root, "run")
    slipstream.init()
    ex = example()
    out = []
    for i, layout in enumerate(layouts):
        ckpt = os.path.join(root, f"ckpt{i}")
        log = CollectiveLog()
        groups: set[str] = set()
        losses = []
        with log:
            for until in (2, 3):
                run = slipstream.accelerate(make_gpt(ex), optimizer_factory, tp_plan=ex.TP_PLAN, progress=False,
                                            profile=False, checkpoint_dir=ckpt, checkpoint_every_steps=1, **layout)
                per_rank = GLOBAL_BATCH // run.dp_size
                rows = slice(run.dp_rank * per_rank, (run.dp_rank + 1) * per_rank)
                while run.step_count < until:
                    x, y = global_batch(run.step_count)
                    losses.append(float(run.train_step(x[rows], y[rows], ex.loss_fn)))
                state = run.unwrapped_state_dict()
                mesh = run.layout.dims.mesh
                groups |= {mesh.get_group(d).group_name for d in mesh.mesh_dim_names}
                run.finish()
        import torch.distributed as dist

        groups.add(dist.distributed_c10d._get_default_group().group_name)
        out.append({"device_groups": log.on(groups), "other_groups": log.on(set(log.calls_groups()) - groups),
                    "losses": losses, "keys": sorted(state)})
    slipstream.shutdown()
    return out
