"""``python -m slipstream.job.worker (SCRIPT | -m MODULE) ARGS``: run the user's
code as ``__main__`` after applying the job spec's GPU memory cap.

``gpu_slice.memory_fraction`` reaches each worker as
``SLIPSTREAM_GPU_MEMORY_FRACTION``; on a CUDA machine this caps the caching
allocator of the worker's device (``LOCAL_RANK``) with
``torch.cuda.set_per_process_memory_fraction``, so several processes can share
one GPU without one of them taking all of its memory. Without CUDA it does
nothing. The launcher puts this module in front of the script only when the
spec asks for a fraction.

Example::

    SLIPSTREAM_GPU_MEMORY_FRACTION=0.25 python -m slipstream.job.worker train.py --steps 10
"""

from __future__ import annotations

import os
import sys

from ..launch.worker import main as run_script

ENV_FRACTION = "SLIPSTREAM_GPU_MEMORY_FRACTION"


def apply_memory_fraction(environ: dict | None = None) -> float | None:
    """Apply the cap from the environment; returns the fraction applied (None if none)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_FRACTION)
    if not raw:
        return None
    try:
        fraction = float(raw)
    except ValueError:
        raise SystemExit(f"slipstream worker: {ENV_FRACTION} must be a number in (0, 1], got {raw!r}") from None
    if not 0.0 < fraction <= 1.0:
        raise SystemExit(f"slipstream worker: {ENV_FRACTION} must be in (0, 1], got {raw!r}")
    import torch

    if not torch.cuda.is_available():
        return None
    device = int(env.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m slipstream.job.worker (SCRIPT | -m MODULE) [ARGS...]")
    if argv[0] == "-m" and len(argv) < 2:
        raise SystemExit("slipstream worker: -m needs a module name")
    apply_memory_fraction()
    run_script(argv)  # as __main__, with the gloo exit wait


if __name__ == "__main__":
    main()
