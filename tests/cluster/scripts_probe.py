"""Worker for the cluster tests: one all-reduce, then each rank reports where its bytes went."""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def tx(ifname: str) -> int:
    with open(f"/sys/class/net/{ifname}/statistics/tx_bytes") as fh:
        return int(fh.read())


out_dir, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "ok")
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if mode == "fail" and rank == world - 1:
    sys.exit(3)
if mode == "hang":
    open(os.path.join(out_dir, f"started{rank}"), "w").close()
    time.sleep(600)
ifname = os.environ["GLOO_SOCKET_IFNAME"]
t = torch.full((1 << 20,), float(rank + 1))  # 4 MiB
dist.barrier()
if_0, lo_0 = tx(ifname), tx("lo")
dist.all_reduce(t)
dist.barrier()
report = {
    "rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
    "node": int(os.environ["SLIPSTREAM_EMULATED_NODE"]), "ifname": ifname,
    "sum": float(t[0]), "if_bytes": tx(ifname) - if_0, "lo_bytes": tx("lo") - lo_0,
}
with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
    json.dump(report, fh)
dist.destroy_process_group()
