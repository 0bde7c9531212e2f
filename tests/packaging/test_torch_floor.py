"""The torch floor in pyproject.toml is the newest release among the torch APIs the code calls.

Each API the engine needs is listed with the torch release that brought it; the floor must
equal the newest of them, and the installed torch must have every one. The source is scanned
too: any `import torch.x` / `from torch.x import y` not importable here fails the test, so a
new dependency on torch gets noticed (and, if it is newer than the floor, listed below).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "slipstream"

# (module, attribute or LaunchConfig field, release that brought it, where that is recorded)
REQUIRED = [
    ("torch.nn.utils", "get_total_norm", (2, 6), "pytorch/pytorch#139662, merged 2024-11-07, after the 2.5 branch cut"),
    ("torch.distributed.fsdp", "fully_shard", (2, 6), "pytorch/pytorch#141868: FSDP2 public in torch.distributed.fsdp, 'targeting 2.6'"),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy", (2, 6), "same PR"),
    ("torch.distributed.launcher.api", "LaunchConfig.event_log_handler", (2, 8),
     "pytorch/pytorch#154644/#155268 (merged 2025-06) add the event log destination to torchrun's LaunchConfig"),
    ("torch.serialization", "get_unsafe_globals_in_checkpoint", (2, 5), "weights_only tooling of 2.5"),
    ("torch.serialization", "safe_globals", (2, 5), "weights_only tooling of 2.5"),
    ("torch.distributed.pipelining", "Schedule1F1B", (2, 4), "torch.distributed.pipelining, new in 2.4"),
    ("torch.distributed.pipelining", "PipelineStage", (2, 4), "torch.distributed.pipelining, new in 2.4"),
    ("torch.distributed.checkpoint", "async_save", (2, 3), "DCP async_save, 2.3"),
    ("torch.amp", "GradScaler", (2, 3), "device-generic GradScaler, 2.3"),
    ("torch.distributed.checkpoint.state_dict", "get_state_dict", (2, 2), "DCP state_dict helpers, 2.2"),
    ("torch.distributed.checkpoint.stateful", "Stateful", (2, 2), "2.2"),
    ("torch.distributed.device_mesh", "init_device_mesh", (2, 2), "DeviceMesh public, 2.2"),
    ("torch.distributed.elastic.multiprocessing", "DefaultLogsSpecs", (2, 2), "LogsSpecs, 2.2"),
    ("torch.distributed.tensor.parallel", "parallelize_module", (2, 2), "2.2"),
]

# Newer APIs used only when the user asks for them (passed only when set, or read with getattr),
# so an older torch still runs everything else: they do not raise the floor.
OPTIONAL = [
    ("torch.numa.binding", "NumaOptions"),                            # slipstream run --numa-binding
    ("torch.distributed.launcher.api", "LaunchConfig.signals_to_handle"),
    ("torch.distributed.launcher.api", "LaunchConfig.duplicate_stdout_filters"),
    ("torch.distributed.launcher.api", "LaunchConfig.virtual_local_rank"),
    ("torch.distributed.launcher.api", "LaunchConfig.shutdown_timeout"),
    ("torch.backends", "fp32_precision"),                              # metrics/profiler: getattr, "none"
]


def _floor() -> tuple[int, ...]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_req,) = [d for d in deps if re.match(r"torch\b", d)]
    m = re.fullmatch(r"torch\s*>=\s*(\d+)\.(\d+)", torch_req.strip())
    assert m, f"torch requirement should be a plain floor, got {torch_req!r}"
    return int(m.group(1)), int(m.group(2))


def _has(module: str, name: str) -> bool:
    mod = importlib.import_module(module)
    if "." in name:  # a dataclass field: Class.field
        cls_name, field = name.split(".")
        return field in {f.name for f in dataclasses.fields(getattr(mod, cls_name))}
    return hasattr(mod, name)


def test_the_floor_is_the_newest_required_api():
    newest = max(since for _, _, since, _ in REQUIRED)
    assert _floor() == newest, f"pyproject says torch>={_floor()}, the newest API needed is from {newest}"


def test_installed_torch_is_at_least_the_floor():
    import torch

    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert installed >= _floor()


@pytest.mark.parametrize("module,name", [(m, n) for m, n, _, _ in REQUIRED] + OPTIONAL)
def test_installed_torch_has_each_api(module, name):
    assert _has(module, name), f"{module}.{name} is missing from the installed torch"


def _torch_imports() -> set[tuple[str, str | None]]:
    found: set[tuple[str, str | None]] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {(a.name, None) for a in node.names if a.name.split(".")[0] == "torch"}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "torch":
                found |= {(node.module, a.name) for a in node.names}
    return found


def test_every_torch_import_in_the_source_resolves():
    imports = _torch_imports()
    assert len(imports) > 30  # the scan sees the code
    missing = []
    for module, name in sorted(imports, key=str):
        try:
            mod = importlib.import_module(module)
            if name is not None and not hasattr(mod, name):
                importlib.import_module(f"{module}.{name}")  # a submodule: from torch.x import y
        except ImportError as exc:
            missing.append(f"{module}{'.' + name if name else ''}: {exc}")
    assert missing == [], "\n".join(missing)
