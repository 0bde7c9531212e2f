"""Acceptance step "binding/per-rank-gpu": one rank per visible GPU, as ``srun --gpus-per-task=1``
or a per-rank ``CUDA_VISIBLE_DEVICES`` gives it: a rank that sees one GPU must use that GPU.

    python -m benchmarks.acceptance.binding --result FILE --device cuda|cpu

For each launcher style (srun with SLURM_* variables, torchrun with RANK/LOCAL_RANK)
and each of 2 ranks on one node, a fresh process is started with that rank's
environment and only the first visible GPU in its ``CUDA_VISIBLE_DEVICES`` (a GPU
cannot be hidden from a process after CUDA starts). It reads its place with
``slipstream.process.runtime.detect_launch_env``, picks its device with ``choose_device``
as ``init()`` does for NCCL, and puts a tensor there. Local rank 1 seeing one GPU
must land on ``cuda:0``, not be refused or sent to a GPU it cannot see.

On the CPU (no GPU to bind) the same processes run and the parse is checked
(rank, local rank, local world size); the device check reports that it needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, torch
from slipstream.process.runtime import choose_device, detect_launch_env
launch = detect_launch_env()
count = torch.cuda.device_count()
out = {"rank": launch.rank, "local_rank": launch.local_rank, "local_world_size": launch.local_world_size,
       "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "device_count": count}
if count:
    try:
        device = choose_device("nccl", None, launch.local_rank, launch.local_world_size, count,
                               os.environ.get("CUDA_VISIBLE_DEVICES"))
        out["device"] = str(torch.ones(1, device=device).device)
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
print("BINDING " + json.dumps(out))
"""


def rank_envs(style: str, gpu: str) -> list[dict[str, str]]:
    """Each rank's launcher variables, with only ``gpu`` visible (per-rank binding)."""
    out = []
    for rank in range(2):
        if style == "srun":
            env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0",
                   "SLURM_NNODES": "1", "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n1",
                   "SLURM_JOB_ID": "1"}
        else:
            env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
        out.append({**env, "CUDA_VISIBLE_DEVICES": gpu})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--result", required=True)
    p.add_argument("--device", choices=("cuda", "cpu"), required=True)
    args = p.parse_args()
    gpu = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_")) and k not in
            ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    checks, figures, tails = [], {}, []
    # All four at once: each is mostly torch's import.
    started = [(style, env, subprocess.Popen([sys.executable, "-c", CHILD], env={**base, **env}, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE))
               for style in ("srun", "torchrun") for env in rank_envs(style, gpu)]
    for style, env, popen in started:
        stdout, stderr = popen.communicate(timeout=120)
        proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
        if True:
            line = next((x for x in proc.stdout.splitlines() if x.startswith("BINDING ")), None)
            rank = env.get("SLURM_PROCID", env.get("RANK"))
            name = f"{style} rank {rank} (CUDA_VISIBLE_DEVICES={gpu})"
            if line is None:
                checks.append({"name": name, "ok": False, "detail": f"exit {proc.returncode}: {proc.stderr[-400:]}"})
                tails.append(proc.stderr[-2000:])
                continue
            got = json.loads(line[len("BINDING "):])
            parse_ok = (got["rank"], got["local_rank"], got["local_world_size"]) == (int(rank), int(rank), 2)
            checks.append({"name": f"{name}: place read", "ok": parse_ok,
                           "detail": f"rank {got['rank']}, local {got['local_rank']} of {got['local_world_size']}"})
            if args.device == "cuda":
                ok = got.get("device") == "cuda:0"
                checks.append({"name": f"{name}: bound to its one visible GPU", "ok": ok,
                               "detail": got.get("device") or got.get("error") or f"{got['device_count']} GPUs seen"})
                figures[f"{style}/rank{rank}"] = got.get("device") or got.get("error", "")[:160]
            else:
                figures[f"{style}/rank{rank}"] = "cpu run: the device check needs CUDA"
    status = "pass" if all(c["ok"] for c in checks) else "fail"
    failed = next((c for c in checks if not c["ok"]), None)
    with open(args.result, "w") as fh:
        json.dump({"status": status, "checks": checks, "figures": figures,
                   "message": f"{failed['name']}: {failed['detail']}" if failed else "",
                   "output_tail": "\n".join(tails)[-3000:]}, fh, indent=1)


if __name__ == "__main__":
    main()
