"""A worker that joins a gloo group, writes its pid to OUT_DIR/pid.RANK, then sleeps until killed
(tests/launch/test_parent_death.py kills its launcher and checks that it dies too)."""

import os
import sys
import time

import torch.distributed as dist

if __name__ == "__main__":
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    path = os.path.join(out_dir, f"pid.{dist.get_rank()}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    while True:
        time.sleep(0.1)
