"""``slipstream export CHECKPOINT --out PATH``: a checkpoint's model weights as one plain file."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  slipstream export ckpt --out gpt.safetensors                  newest complete checkpoint under ckpt/
  slipstream export ckpt/step_00000200 --format torch --out gpt.pt
  slipstream export s3://bucket/run1 --out gpt.safetensors      read in place from an object store

then, in plain PyTorch (no process group, any layout the run used):
  from safetensors.torch import load_file
  model.load_state_dict(load_file("gpt.safetensors"), strict=True)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "export",
        help="write a checkpoint's model weights as one safetensors or torch file",
        description="Write the model weights of a checkpoint written by any layout (DDP, FSDP2, TP, PP)\n"
        "under their original parameter names, as full tensors, without the optimizer state:\n"
        "the file loads into the plain model with load_state_dict(strict=True).\n\n"
        "CHECKPOINT: a checkpoint directory (its newest complete step) or one step_N directory;\n"
        "or the same in an object store, as an fsspec URL (s3://bucket/run1, gs://..., az://...),\n"
        "read in place, credentials and endpoint from the environment as in training\n"
        "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, AWS_ENDPOINT_URL, FSSPEC_S3_<OPTION>).\n"
        "A step without its COMMITTED marker (a save cut short) is never read.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("--out", required=True, metavar="PATH", help="local file to write")
    # Checked by the export itself (one line, exit 2), not by argparse's choices.
    p.add_argument("--format", dest="fmt", default="safetensors", metavar="FORMAT",
                   help="safetensors (default) or torch (a torch.save of the state dict)")
    p.add_argument("--force", action="store_true", help="replace PATH if it exists")
    p.add_argument("--verify", default="full", metavar="MODE",
                   help="check the checkpoint's files against its marker first: full (sizes and checksums, "
                   "default), size, off")
    p.set_defaults(func=main)


FORMATS = ("safetensors", "torch")
VERIFY_MODES = ("full", "size", "off")


def check_export_args(args: argparse.Namespace) -> None:
    """--format, --verify and --out, before the checkpoint is read: flag, rule and value."""
    import os

    from ..errors import UsageError, did_you_mean

    for flag, value, known in (("--format", args.fmt, FORMATS), ("--verify", args.verify, VERIFY_MODES)):
        if value not in known:
            raise UsageError(f"{flag}: unknown {flag[2:]} {value!r}: choose one of {', '.join(known)}"
                             + did_you_mean(value, known, quote=True))
    if "://" in args.out:  # else written to a local folder named "s3:"
        raise UsageError(f"--out must be a local file path (copy the file to an object store after), got {args.out!r}")
    if os.path.isdir(args.out) or not _creatable(args.out):
        raise UsageError(f"--out must be a file path (its folders are made), got {args.out!r}")


def main(args: argparse.Namespace) -> int:
    from ..checkpoint.export import ExportRequest, export_checkpoint

    check_export_args(args)

    result = export_checkpoint(ExportRequest(args.checkpoint, args.out, args.fmt, force=args.force,
                                             verify=args.verify))
    print(f"exported {result.tensors} tensors ({result.bytes / 2**20:.1f} MiB) of {result.source} "
          f"(step {result.step}) to {result.out}")
    return 0


def _creatable(path: str) -> bool:
    """Whether ``path``'s folders exist or can be made: its nearest existing ancestor is a directory."""
    import os

    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return os.path.isdir(parent)
