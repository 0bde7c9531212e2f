"""A worker whose configuration is wrong: raises slipstream.errors.ConfigError.

``scripts_config_error.py [--before-init] [--marker DIR] [--only-rank R]``: by default after
``slipstream.init()`` (the error then leaves through init's excepthook), with
``--before-init`` before any process group exists (through the worker entry of
``slipstream run``). ``--marker DIR``: each start touches a file there, so a test
can count attempts. ``--only-rank R``: only rank R raises (after init), once the others
are waiting in an all-reduce it never joins (each leaves a file in-collective-rankN in
the current directory), so they see its connection close.
"""

import argparse
import os

import slipstream
from slipstream.errors import ConfigError

parser = argparse.ArgumentParser()
parser.add_argument("--before-init", action="store_true")
parser.add_argument("--marker", default=None)
parser.add_argument("--only-rank", type=int, default=None)
args = parser.parse_args()
if args.marker:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    open(os.path.join(args.marker, f"start-rank{os.environ.get('RANK', '0')}-attempt{attempt}"), "w").close()
if not args.before_init:
    slipstream.init()
if args.only_rank is not None and int(os.environ["RANK"]) != args.only_rank:
    import torch
    import torch.distributed as dist

    work = dist.all_reduce(torch.ones(4), async_op=True)  # waits for rank R, which leaves instead
    open(f"in-collective-rank{os.environ['RANK']}", "w").close()
    work.wait()
    raise SystemExit("unreachable: the all-reduce completed without rank R")
if args.only_rank is not None:
    import time

    others = int(os.environ["WORLD_SIZE"]) - 1  # leave once the others are inside the all-reduce
    while len([f for f in os.listdir(".") if f.startswith("in-collective-rank")]) < others:
        time.sleep(0.05)
raise ConfigError("checkpoint_dir exists and is not a directory: /no/such/ckpt (on purpose)")
