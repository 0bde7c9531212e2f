"""A tiny job for `slipstream run examples/jobs/local-2x1.yaml`: every rank
all-reduces its rank over gloo and rank 0 writes the sum to --out."""

import argparse
import os

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
if dist.get_rank() == 0:
    with open(args.out, "w") as fh:
        fh.write(f"world_size={dist.get_world_size()} sum={int(t.item())} "
                 f"group_rank={os.environ['GROUP_RANK']} job={os.environ.get('SLIPSTREAM_JOB_NAME')} "
                 f"precision={os.environ.get('SLIPSTREAM_PRECISION', 'fp32')}\n")
dist.destroy_process_group()
