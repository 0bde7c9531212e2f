"""Training worker for the fault-injection tests.

Deterministic: sample i of the job is a pure function of i; step s consumes
global samples [s*G, (s+1)*G), split in contiguous blocks over the ranks, so
the same samples are used whatever the world size. Each rank appends
"step world_size first_id last_id" to OUT/ids_rank<R>.log for every step it
runs (a step redone after a restart appears again; the last line counts); rank 0 writes OUT/final.pt (model and optimizer) at the end and
OUT/resumed_<attempt>.pt right after resuming.

Failures are injected on the first attempt only (TORCHELASTIC_RESTART_COUNT=0)
unless --mode fail-always; --kill-at's once each (a marker file), for replacements
that heal in place (slipstream run --heal) and restarts alike.
"""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import slipstream

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--global-batch", type=int, default=8)
p.add_argument("--ckpt", default=None)
p.add_argument("--every", type=int, default=None)
p.add_argument("--async-save", action="store_true")
p.add_argument("--dropout", type=float, default=0.1)
p.add_argument("--mode", default="none",
               choices=["none", "sigkill", "exception", "hang", "sigterm", "kill-in-save", "fail-always"])
p.add_argument("--fail-rank", type=int, default=1)
p.add_argument("--fail-step", type=int, default=5)
p.add_argument("--step-sleep-s", type=float, default=0.0)
p.add_argument("--kill-at", default="", metavar="R:S[,R:S]",
               help="SIGKILL rank R at the top of step S, once each (a marker file in OUT), whatever the attempt")
p.add_argument("--sync", default=None, help="the sync strategy (tests/integration/test_heal_strategies.py)")
p.add_argument("--sync-options", default=None, help="its options, as JSON")
p.add_argument("--force-auto-codec", default=None,
               help="auto's plan forced onto this codec for every bucket (its timings differ run to run)")
p.add_argument("--chaos", default="", metavar="R:S:PHASE[:SIG][,...]",
               help="SIG (KILL or STOP) to rank R inside PHASE of step S, once each (scripts_chaos.py)")
p.add_argument("--wrap-comm-hook", action="store_true",
               help="run DDP's reduction through a Python comm hook (the comm-hook phase; give it to the reference too)")
p.add_argument("--dp-shard", type=int, default=None, help="a mesh layout (FSDP2): its dp_shard degree")
p.add_argument("--dp-replicate", type=int, default=None, help="with --dp-shard: HSDP's replica count")
p.add_argument("--tp", type=int, default=None, help="a mesh layout: tensor parallelism over the two Linears")
args = p.parse_args()
# A mesh layout (FSDP2 / tensor parallel) shards the state: its collectives run on every rank, and the
# optimizer takes the GPU's foreach default as the suite does (tests/gpu_defaults.py).
mesh = args.dp_shard is not None or args.tp is not None
if mesh:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from tests.gpu_defaults import take_gpu_optimizer_defaults

    take_gpu_optimizer_defaults()

import scripts_chaos  # noqa: E402 - this script's folder is on sys.path

chaos = scripts_chaos.Chaos(args.chaos, args.out, int(os.environ.get("RANK", "0")))
os.makedirs(args.out, exist_ok=True)
chaos.install_early()
hooks = scripts_chaos.wrap_comm_hooks(chaos) if args.wrap_comm_hook else None

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rt = slipstream.init()
# A process that replaces a dead rank in place (slipstream run --heal) is not a first attempt either.
replacement = os.environ.get("SLIPSTREAM_HEAL_REPLACEMENT") == "1"
inject = (attempt == 0 and not replacement or args.mode == "fail-always") and rt.rank == args.fail_rank

if args.mode == "kill-in-save" and inject:
    # Die after this rank's checkpoint data is on disk but before the
    # checkpoint is finished: the directory stays ".partial".
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    real_write = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        fut = real_write(self, plan, planner)
        fut.wait()
        if f"step_{args.fail_step + 1:08d}" in str(self.path):
            os.kill(os.getpid(), signal.SIGKILL)
        return fut

    FileSystemWriter.write_data = write_then_die

if args.force_auto_codec:
    from slipstream.sync import auto as _auto_engine

    _real_decide = _auto_engine.decide

    def _forced(buckets, *a, **k):
        d = _real_decide(buckets, *a, **k)
        d.choices = {b.index: args.force_auto_codec for b in buckets}
        return d

    _auto_engine.decide = _forced

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(args.dropout), nn.Linear(32, 4))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
chaos.install_on_model(model)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
if mesh:  # the layout rebuilds the optimizer over the sharded parameters: a scheduler factory
    scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)  # noqa: E731
layout = dict(dp_shard=args.dp_shard, dp_replicate=args.dp_replicate, tp=args.tp, tp_plan={"0": "colwise", "3": "rowwise"} if args.tp else None)
run = slipstream.accelerate(
    model, optimizer, scheduler=scheduler, checkpoint_dir=args.ckpt, checkpoint_every_steps=args.every,
    checkpoint_async=args.async_save, progress=False, log_every_steps=1, **(layout if mesh else {}),
    sync=args.sync, sync_options=json.loads(args.sync_options) if args.sync_options else None,
)
if mesh:
    optimizer = run.optimizer  # the layout rebuilt it over the sharded parameters
chaos.install_on_run(run)
if hooks == []:  # no strategy hook: DDP's reduction through torch's Python one
    scripts_chaos.default_comm_hook(chaos, run.model)


def final_state():
    """Model (whole) and optimizer state; on a mesh layout this rank's shards (DTensors as local tensors)."""
    state = optimizer.state_dict()
    if mesh:
        from torch.distributed.tensor import DTensor

        state = {"state": {k: {n: v.to_local() if isinstance(v, DTensor) else v for n, v in s.items()}
                           for k, s in state["state"].items()}}
    return {"model": run.unwrapped_state_dict(), "optimizer": state}  # a collective on a mesh layout


# On a mesh layout a collective: not in a replacement that healed in place (the others did not resume).
if run.resumed_from_step is not None and (mesh and not replacement or rt.rank == 0 and not mesh):
    resumed = final_state()
    if rt.rank == 0:
        torch.save({"step": run.resumed_from_step, **resumed}, os.path.join(args.out, f"resumed_{attempt}.pt"))

W, G = (run.dp_size, args.global_batch) if mesh else (rt.world_size, args.global_batch)
B = G // W


def sample(i: int):
    chaos.point("data")
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, generator=g), i % 4


log = open(os.path.join(args.out, f"ids_rank{rt.rank}.log"), "a")
kills = set(filter(None, args.kill_at.split(",")))
while run.step_count < args.steps:
    step = chaos.step = run.step_count
    if f"{rt.rank}:{step}" in kills and not os.path.exists(os.path.join(args.out, f"killed_{rt.rank}_{step}")):
        open(os.path.join(args.out, f"killed_{rt.rank}_{step}"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    if inject and step == args.fail_step:
        if args.mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif args.mode in ("exception", "fail-always"):
            raise RuntimeError(f"injected failure at step {step} (attempt {attempt})")
        elif args.mode == "hang":
            with open(os.path.join(args.out, "hang_started"), "w") as f:
                f.write(str(time.time()))
            time.sleep(3600)
        elif args.mode == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
    first = step * G + (run.dp_rank if mesh else rt.rank) * B
    xs, ys = zip(*(sample(i) for i in range(first, first + B)))
    loss = F.cross_entropy(run.model(torch.stack(xs)), torch.tensor(ys))
    run.backward(loss)
    # Logged before run.step(), which may end the process (preemption) once the step is saved.
    log.write(f"{step} {W} {first} {first + B - 1}\n")
    log.flush()
    run.step()
    if args.step_sleep_s:
        time.sleep(args.step_sleep_s)

run.finish()
if mesh:
    torch.save(final_state(), os.path.join(args.out, f"final_rank{rt.rank}.pt"))
elif rt.rank == 0:
    torch.save({"model": run.unwrapped_state_dict(), "optimizer": optimizer.state_dict(),
                "sync_decision": run.sync_state.decision_summary() if run.sync_state is not None else None},
               os.path.join(args.out, "final.pt"))
slipstream.shutdown(exit_code=0)  # skip interpreter teardown (gloo may abort there)
