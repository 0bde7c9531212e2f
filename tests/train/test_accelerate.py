"""accelerate() under gloo: exact gradients, accumulation without sync, precision paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tests.harness import run_ranks

pytestmark = pytest.mark.distributed

IN, HIDDEN, OUT, PER_RANK = 12, 24, 5, 6


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def global_batch(world_size: int, step: int = 0):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(world_size * PER_RANK, IN, generator=g)
    y = torch.randint(0, OUT, (world_size * PER_RANK,), generator=g)
    return x, y


def _grads_one_step(rank: int, world_size: int, options: dict) -> dict[str, torch.Tensor]:
    import slipstream

    slipstream.init()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    run = slipstream.accelerate(model, opt, progress=False, run_dir=None, **options)
    x, y = global_batch(world_size)
    xs, ys = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
    loss = F.cross_entropy(run.model(xs), ys)
    run.backward(loss)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_grads(world_size: int) -> dict[str, torch.Tensor]:
    model = make_model()
    x, y = global_batch(world_size)
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_gradients_equal_single_process_on_concatenated_batch(world_size, tmp_path):
    grads = run_ranks(_grads_one_step, world_size, {"bucket_cap_mb": 0.001})  # tiny buckets: many of them
    ref = reference_grads(world_size)
    for rank_grads in grads:
        for name, g in ref.items():
            torch.testing.assert_close(rank_grads[name], g, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")


def _accumulate(rank: int, world_size: int, accumulate_steps: int, optimizer_steps: int):
    import slipstream
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    slipstream.init()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = slipstream.accelerate(model, opt, progress=False, accumulate_steps=accumulate_steps, bucket_cap_mb=0.001)
    calls = []

    def counting_hook(state, bucket):
        calls.append(len(calls))
        return allreduce_hook(state, bucket)

    run.model.register_comm_hook(None, counting_hook)
    per_step_calls = []
    stepped = []
    for step in range(optimizer_steps):
        x, y = global_batch(world_size * accumulate_steps, step)
        for micro in range(accumulate_steps):
            before = len(calls)
            lo = (micro * world_size + rank) * PER_RANK
            loss = F.cross_entropy(run.model(x[lo : lo + PER_RANK]), y[lo : lo + PER_RANK])
            run.backward(loss)
            per_step_calls.append(len(calls) - before)
            stepped.append(run.step().stepped)
    return per_step_calls, stepped, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_accumulation_syncs_only_on_the_last_micro_step():
    accumulate, steps, world = 3, 2, 2
    results = run_ranks(_accumulate, world, accumulate, steps)
    # Reference: the same samples as one big batch per optimizer step.
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = global_batch(world * accumulate, step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    for per_step_calls, stepped, params in results:
        # DDP rebuilds its buckets after the first synchronised backward, so
        # the count may change between optimizer steps, never within.
        assert max(per_step_calls) > 1, "the test wants several buckets"
        for i, calls in enumerate(per_step_calls):
            boundary = i % accumulate == accumulate - 1
            assert (calls > 0) if boundary else (calls == 0), f"micro-step {i}: {calls} all-reduces"
            assert stepped[i] == boundary
        for name, p in model.named_parameters():
            torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6)


def _train(rank: int, world_size: int, options: dict, steps: int):
    import slipstream

    slipstream.init()
    model = make_model(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    run = slipstream.accelerate(model, opt, progress=False, log_every_steps=1, **options)
    losses = []
    g = torch.Generator().manual_seed(7)
    x = torch.randn(PER_RANK * 4, IN, generator=g)
    y = torch.randint(0, OUT, (PER_RANK * 4,), generator=g)
    for _ in range(steps):
        loss = F.cross_entropy(run.model(x), y)
        run.backward(loss)
        run.step()
        losses.append(run.recorder.last_record["loss"])
    return losses, run.scaler is not None, run.last_grad_norm


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(precision):
    results = run_ranks(_train, 2, {"precision": precision, "grad_clip_norm": 5.0}, 30)
    for losses, has_scaler, grad_norm in results:
        assert losses[-1] < 0.5 * losses[0], f"{precision}: loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        assert has_scaler == (precision == "fp16")
        assert grad_norm is not None and torch.isfinite(grad_norm)


def _clip(rank: int, world_size: int):
    import slipstream

    slipstream.init()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    run = slipstream.accelerate(model, opt, progress=False, grad_clip_norm=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = global_batch(world_size)
    run.backward(F.cross_entropy(run.model(x), y))
    run.step()
    delta = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    return float(delta), float(run.last_grad_norm)


def test_gradient_clipping_bounds_the_update():
    for delta, norm in run_ranks(_clip, 2):
        assert norm > 0.01  # the raw gradient was larger than the bound...
        assert delta == pytest.approx(0.01, rel=1e-3)  # ...and the SGD update (lr 1) was clipped to it


def _checkpointed(rank: int, world_size: int):
    import slipstream

    slipstream.init()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    run = slipstream.accelerate(model, opt, progress=False, activation_checkpointing=("Linear",))
    x, y = global_batch(world_size)
    xs, ys = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
    run.backward(F.cross_entropy(run.model(xs), ys))
    wrapped = sum("CheckpointWrapper" in type(m).__name__ for m in model.modules())
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return grads, wrapped, list(run.unwrapped_state_dict())


def test_activation_checkpointing_keeps_gradients_and_state_dict_keys():
    ref = reference_grads(2)
    for grads, wrapped, keys in run_ranks(_checkpointed, 2):
        assert wrapped == 3
        assert keys == list(make_model().state_dict())
        for name, g in ref.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6)


def _init_info(rank: int, world_size: int):
    import slipstream

    rt = slipstream.init()
    t = torch.tensor([float(rt.rank)])
    torch.distributed.all_reduce(t)
    return rt.launch.launcher, rt.rank, rt.world_size, rt.local_rank, float(t)


@pytest.mark.parametrize(
    "launcher,env",
    [
        ("slurm", {"SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_JOB_ID": "4242"}),
        ("mpi", {}),
    ],
)
def test_init_recognises_srun_and_mpirun(launcher, env, monkeypatch):
    from tests import harness

    def entry_env(rank):
        if launcher == "slurm":
            return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), **env}
        return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}

    results = run_ranks(_as_other_launcher, 2, launcher, entry_env(0), entry_env(1), harness.free_port())
    assert [r[:4] for r in results] == [(launcher, 0, 2, 0), (launcher, 1, 2, 1)]
    assert all(r[4] == 1.0 for r in results)


def _as_other_launcher(rank, world_size, launcher, env0, env1, port):
    import os

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(key)
    os.environ.update(env0 if rank == 0 else env1)
    os.environ["MASTER_PORT"] = str(port)
    return _init_info(rank, world_size)
