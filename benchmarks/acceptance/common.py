"""Helpers shared by the acceptance run's step programs (they run in subprocesses).

The orchestrator (benchmarks/gpu_acceptance.py) imports none of this: it does
not import torch at all, so it never touches CUDA and still writes its report
when torch itself is broken.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]


def write_result(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """Write a step's result JSON atomically (the orchestrator may read it after a kill)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(tmp, path)


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and raw bytes: equal digests mean torch.equal
    (and the same dtype), bit for bit, including NaN payloads and signed zeros."""
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor: the caller decides whether its local part means anything
        t = t.to_local()
    t = t.cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """One digest over a state_dict (names sorted), for equality across ranks."""
    h = hashlib.sha256()
    for name in sorted(state):
        value = state[name]
        if isinstance(value, torch.Tensor):
            h.update(f"{name}={tensor_digest(value)};".encode())
    return h.hexdigest()


def compare_states(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Differences between two state_dicts as readable lines (empty: bitwise equal)."""
    problems = []
    if set(a) != set(b):
        problems.append(f"keys differ: only in first {sorted(set(a) - set(b))[:5]}, only in second {sorted(set(b) - set(a))[:5]}")
    for name in sorted(set(a) & set(b)):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            problems.append(f"{name}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        elif not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float("nan")
            problems.append(f"{name}: max |diff| {diff:.3g}")
    return problems


def make_deterministic(strict: bool = True) -> None:
    """Deterministic kernels, so that two runs of the same steps give the same bits.

    Bitwise resume checks compare runs; on a GPU, atomics in some backward
    kernels (attention, embedding, pooling) make even two uninterrupted runs
    differ in the last bits, and the check would then say nothing about
    checkpoints. Strict mode is what makes scaled_dot_product_attention's flash
    and memory-efficient backward deterministic (with warn_only they warn and
    stay atomic); an op with no deterministic version then raises, and the
    caller retries with ``strict=False`` (warn only), where the reference run
    against an uninterrupted twin shows whether the result still reproduces.
    CUBLAS_WORKSPACE_CONFIG must be in the environment before cuBLAS starts
    (the caller sets it).
    """
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def load_example(name: str):
    """examples/<name>.py as a module (its model, data and plans), without running main()."""
    path = ROOT / "examples" / f"{name}.py"
    if not path.exists():
        raise FileNotFoundError(f"the acceptance run needs {path}, which is missing")
    module_name = f"_acceptance_example_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def peak_memory_bytes(device: torch.device) -> tuple[int, str]:
    """(bytes, what was measured): the CUDA caching allocator's peak on a GPU; the
    process's peak resident set on the CPU (ru_maxrss, a lifetime high-water mark)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "torch.cuda.max_memory_allocated"
    import resource

    # Linux reports ru_maxrss in KiB.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "ru_maxrss (process lifetime peak)"
