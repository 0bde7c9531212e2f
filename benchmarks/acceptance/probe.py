"""Acceptance step "environment": what this machine has, and whether Slipstream's
runtime places a rank where asked.

    python -m benchmarks.acceptance.probe --device cuda --result r.json

Records torch/CUDA/NCCL/cuDNN versions, the GPU, the sync strategies this
Slipstream offers (the orchestrator plans one check per strategy from them), and
starts a one-rank gloo group on the requested device (SLIPSTREAM_BACKEND=gloo,
SLIPSTREAM_DEVICE=DEVICE) with one all-reduce of a tensor on that device: the
multi-rank steps share one GPU exactly this way, so if it fails they cannot run.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
import traceback

from benchmarks.acceptance.common import write_result


def nccl_version() -> str | None:
    """NCCL's version as text (torch returns a tuple, an int in older releases), or None."""
    try:
        import torch.cuda.nccl as nccl

        version = nccl.version()
    except Exception:  # noqa: BLE001 - a torch built without NCCL: recorded as None, not fatal
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def describe(device: str) -> dict:
    import torch

    import slipstream
    from slipstream import sync

    info: dict = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
        "sync_available": list(sync.available()),
        "slipstream_file": slipstream.__file__,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            cuda_runtime=torch.version.cuda,
            device_count=torch.cuda.device_count(),
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(props.total_memory / 2**30, 1),
            bf16_supported=torch.cuda.is_bf16_supported(),
            cudnn=torch.backends.cudnn.version(),
            nccl=nccl_version(),
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
    return info


def placement_check(device: str) -> dict:
    """One rank, gloo, tensors on ``device``: what every multi-rank step relies on."""
    import torch
    import torch.distributed as dist

    import slipstream

    os.environ["SLIPSTREAM_BACKEND"] = "gloo"
    os.environ["SLIPSTREAM_DEVICE"] = device
    rt = slipstream.init()
    t = torch.ones(4, device=rt.device)
    dist.all_reduce(t)
    ok = rt.backend == "gloo" and rt.device.type == device and t.device.type == device and bool((t == 1).all())
    return {"backend": rt.backend, "device": str(rt.device), "ok": ok}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="device to check placement on (default: cuda if available, else cpu)")
    p.add_argument("--result", required=True)
    args = p.parse_args()
    started = time.perf_counter()
    result: dict = {"status": "fail", "checks": [], "figures": {}}
    try:
        info = describe(args.device or "cpu")
        device = args.device or ("cuda" if info["cuda_available"] else "cpu")
        info["device_chosen"] = device
        info["device_usable"] = device == "cpu" or info["cuda_available"]
        result["environment"] = info
        if device == "cuda" and not info["cuda_available"]:
            raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device "
                               f"(torch {info['torch']}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        placed = placement_check(device)
        result["checks"].append({"name": f"gloo group with {device} tensors (what the multi-rank steps use)",
                                 "ok": placed["ok"], "detail": f"backend {placed['backend']}, device {placed['device']}"})
        result["figures"] = {"torch": info["torch"], "device": info.get("device_name", "cpu"),
                             "sync_strategies": len(info["sync_available"])}
        result["status"] = "pass" if placed["ok"] else "fail"
    except Exception as exc:  # noqa: BLE001 - reported in the result, the orchestrator decides
        result["message"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
    result["seconds"] = round(time.perf_counter() - started, 2)
    write_result(args.result, result)
    code = 0 if result["status"] == "pass" else 1
    try:
        import slipstream

        # Leave without interpreter teardown (torch's gloo can abort there; see slipstream.shutdown).
        slipstream.shutdown(exit_code=code)
    except ImportError:
        pass
    raise SystemExit(code)


if __name__ == "__main__":
    main()
