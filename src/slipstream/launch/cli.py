"""``slipstream run``: argument parsing for the launcher (the flags become a :class:`LaunchOptions`)."""

from __future__ import annotations

import argparse

from ..config import TrainConfig
from ..errors import ConfigError, UsageError
from .api import LaunchOptions, launch

# Flags that feed defaults into the training config of every worker.
_TRAIN_FLAGS = (
    ("--sync", "sync", str, "gradient sync strategy (allreduce, bf16, fp16, powersgd, topk, sign, hierarchical[+X], auto)"),
    ("--sync-options", "sync_options", lambda text: _json_object(text), 'strategy options as JSON, e.g. \'{"rank": 4}\''),
    ("--precision", "precision", str, "fp32, bf16 or fp16"),
    ("--accumulate-steps", "accumulate_steps", int, "micro-steps per optimizer step"),
    ("--bucket-cap-mb", "bucket_cap_mb", float, "DDP bucket size in MiB"),
    ("--grad-clip-norm", "grad_clip_norm", float, "clip the gradient 2-norm to this value"),
    ("--run-dir", "run_dir", str, "directory for metrics and run artefacts"),
    ("--log-every-steps", "log_every_steps", int, "read the loss back and log every N steps"),
    ("--checkpoint-dir", "checkpoint_dir", str, "save checkpoints here and resume from the newest complete one"),
    ("--checkpoint-every-steps", "checkpoint_every_steps", int, "save every N optimizer steps"),
    ("--checkpoint-every-s", "checkpoint_every_s", float, "save when N seconds passed since the last save"),
    ("--checkpoint-keep-last", "checkpoint_keep_last", int, "complete checkpoints kept (default 3)"),
    ("--checkpoint-verify", "checkpoint_verify", str,
     "check a checkpoint before loading it: full (sizes and CRC-32, the default), size or off"),
    ("--checkpoint-max-failures", "checkpoint_max_failures", int,
     "failed saves in a row before the run gives up with exit 1 (default 3)"),
    # Parallel layout (docs/parallel.md): dp_replicate * dp_shard * tp * pp = world size.
    ("--dp-replicate", "dp_replicate", int, "replicated data-parallel degree (-1: the rest of the world, the default)"),
    ("--dp-shard", "dp_shard", int, "FSDP2 sharded data-parallel degree (-1: the rest of the world)"),
    ("--tp", "tp", int, "tensor-parallel degree"),
    ("--pp", "pp", int, "pipeline-parallel stages"),
    ("--pp-schedule", "pp_schedule", str, "pipeline schedule: gpipe or 1f1b"),
    ("--pp-microbatches", "pp_microbatches", int, "micro-batches per pipeline step (must divide the batch)"),
    ("--zero-stage", "zero_stage", int, "with --dp-shard: 3 (reshard after forward) or 2 (keep gathered)"),
)


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="launch a training script on this node (torchrun-compatible)",
        description="Launch SCRIPT in N worker processes through torch's elastic agent. "
        "An unmodified torchrun script runs unchanged.",
        # No prefix matching: the script's own flags (--checkpoint-every, say)
        # must reach the script, not be taken as abbreviations of ours.
        allow_abbrev=False,
    )
    p.add_argument("-n", "--nproc-per-node", type=int, default=1, metavar="N", help="workers on this node (default 1)")
    p.add_argument("--nnodes", default="1", metavar="MIN[:MAX]", help="number of nodes, or an elastic range (default 1)")
    p.add_argument("--node-rank", type=int, default=None, metavar="R", help="rank of this node; 0 hosts the store")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help="rendezvous store every node joins")
    p.add_argument("--rdzv-id", default=None, metavar="ID", help="job id shared by all nodes of one run")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K", help="restart the workers up to K times")
    p.add_argument("--local-addr", default=None, help="address this node publishes to the others")
    p.add_argument(
        "--rdzv-conf", default="", metavar="K=V[,K=V]",
        help="c10d rendezvous settings, e.g. last_call_timeout=5,keep_alive_interval=2",
    )
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a Python module name (python -m)")
    p.add_argument(
        "--collective-timeout-s", type=float, default=None, metavar="S",
        help="a collective waiting longer fails, is diagnosed (which rank stalled, where) and the group restarts",
    )
    # Checked in worker_env_from_args rather than with argparse choices, so a bad
    # value is one line and exit 2 like every other flag error.
    p.add_argument("--backend", default=None, metavar="{nccl,gloo}",
                   help="process-group backend of the workers (default: nccl with GPUs, else gloo)")
    p.add_argument("--device", default=None, metavar="{cuda,cpu}",
                   help="workers' device (default: cuda for nccl, cpu for gloo); "
                   "--backend gloo --device cuda lets ranks share a GPU on purpose")
    p.add_argument("--emulate", default=None, metavar="NODESxPROCS",
                   help="run on an emulated cluster on this machine: one network namespace per node (needs root)")
    p.add_argument("--link", default="unshaped", metavar="RATE",
                   help="with --emulate: each node's link rate, both directions (1gbit, 200mbit, unshaped)")
    for flag, dest, kind, text in _TRAIN_FLAGS:
        p.add_argument(flag, dest=f"train_{dest}", type=kind, default=None, help=text)
    p.add_argument("script", metavar="SCRIPT", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    p.set_defaults(func=main)


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    parts = text.split(":")
    try:
        values = [int(x) for x in parts]
    except ValueError:
        raise UsageError(f"--nnodes must be N or MIN:MAX with whole numbers, got {text!r}") from None
    if len(values) == 1:
        return values[0], values[0]
    if len(values) == 2:
        return values[0], values[1]
    raise UsageError(f"--nnodes must be N or MIN:MAX, got {text!r}")


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """``"a=1,b=2"`` -> {"a": "1", "b": "2"}."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise UsageError(f"--rdzv-conf must be KEY=VALUE pairs separated by commas, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def worker_env_from_args(args: argparse.Namespace) -> dict[str, str]:
    """The SLIPSTREAM_* variables for the training flags given, checked now."""
    overrides = {
        dest: getattr(args, f"train_{dest}")
        for _, dest, _, _ in _TRAIN_FLAGS
        if getattr(args, f"train_{dest}") is not None
    }
    try:
        cfg = TrainConfig.from_env(environ={}, **overrides)
        nproc = getattr(args, "nproc_per_node", None)
        nnodes = getattr(args, "nnodes", None)
        if isinstance(nproc, int) and isinstance(nnodes, str) and nnodes.isdigit() and not getattr(args, "emulate", None):
            cfg.degrees(nproc * int(nnodes))  # a layout that cannot fit the world fails now, not in every worker
    except ConfigError as exc:
        raise UsageError(f"invalid training flag: {exc}") from None
    env = cfg.to_env()
    run_dir = cfg.run.dir
    if run_dir is not None:
        env["SLIPSTREAM_RUN_DIR"] = run_dir
    timeout_s = getattr(args, "collective_timeout_s", None)
    if timeout_s is not None:
        if timeout_s <= 0:
            raise UsageError(f"--collective-timeout-s must be > 0, got {timeout_s}")
        env["SLIPSTREAM_COLLECTIVE_TIMEOUT_S"] = str(timeout_s)
    env.update(_placement_env(getattr(args, "backend", None), getattr(args, "device", None)))
    return env


def _placement_env(backend: str | None, device: str | None) -> dict[str, str]:
    """SLIPSTREAM_BACKEND / SLIPSTREAM_DEVICE for --backend / --device, which runtime.init() reads
    as its defaults."""
    from ..runtime import BACKENDS, DEVICES

    env: dict[str, str] = {}
    if backend is not None:
        if backend not in BACKENDS:
            raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        env["SLIPSTREAM_BACKEND"] = backend
    if device is not None:
        if device not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
        env["SLIPSTREAM_DEVICE"] = device
    if backend == "nccl" and device == "cpu":
        raise UsageError("--backend nccl cannot run on --device cpu (NCCL carries CUDA tensors only); "
                         "use --backend gloo for the CPU")
    return env


def main(args: argparse.Namespace) -> int:
    """``slipstream run SCRIPT``: the flags as a :class:`LaunchOptions`, then :func:`launch`.

    ``slipstream run JOB.yaml`` never reaches here: the top-level command sends it to
    ``slipstream.job.cli.run_main`` (the job package uses the launcher, not the reverse).
    """
    min_nodes, max_nodes = parse_nnodes(args.nnodes)
    script_args = list(args.script_args)
    if script_args[:1] == ["--"]:
        script_args = script_args[1:]
    opts = LaunchOptions(
        entrypoint=args.script,
        args=script_args,
        nproc_per_node=args.nproc_per_node,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        max_restarts=args.max_restarts,
        module=args.module,
        local_addr=args.local_addr,
        worker_env=worker_env_from_args(args),
        rdzv_conf=parse_rdzv_conf(args.rdzv_conf),
    )
    if args.emulate:
        from .emulate import parse_shape, run_emulated

        nodes, procs = parse_shape(args.emulate)
        return run_emulated(nodes, procs, args.link, opts)
    return launch(opts)
