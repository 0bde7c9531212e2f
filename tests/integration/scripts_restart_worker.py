"""A torchrun-style worker for launcher tests (plain torch.distributed, no slipstream).

Forms the gloo mesh and all-reduces once; on the first attempt rank
``--kill-rank`` then SIGKILLs itself, so the restarted attempt must build a
new mesh. Each rank writes its environment and result to OUT/rank{R}.json.
"""

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--fail-always", action="store_true")
args = p.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if args.fail_always and rank == 0:
    raise SystemExit(f"rank 0 fails on purpose (attempt {attempt})")
if rank == args.kill_rank and attempt == 0:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_MAX_RESTARTS", "SLIPSTREAM_PRECISION"]
with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
    json.dump({"env": {k: os.environ.get(k) for k in keys}, "sum": t.item()}, f)
dist.barrier()  # leave together: gloo torn down under a live peer can abort at exit
dist.destroy_process_group()
