"""A checkpoint's model weights as one plain file: ``slipstream export``.

A checkpoint written by any layout (DDP, FSDP2, tensor or pipeline parallel, on
any number of ranks) holds the model under ``model_optimizer.model.<name>``,
where ``<name>`` is the original module's parameter or buffer name: the layouts
register the model through torch's distributed state-dict API
(:class:`~slipstream.checkpoint.states.ModelOptimizerState`), which removes
the wrappers' prefixes (DDP's ``module.``, torch.compile's ``_orig_mod.``,
activation checkpointing's) and saves DTensor shards with their global shape.
A pipeline stage saves the parameters it holds; together the stages hold the
whole model (a weight tied across the first and last stage under each of its
names).

Export reads those entries in this one process with DCP's offline load
(``dcp.load`` without a process group into full-size tensors built from the
checkpoint's metadata: every shard lands in its place), drops the optimizer
and everything else, and writes ``{name: tensor}`` with torch.save or as
safetensors. The result loads into the plain model with
``model.load_state_dict(state, strict=True)``. The metadata is checked before
it is unpickled, and non-tensor entries load ``weights_only``
(:mod:`.safe_load`); the checkpoint's files are verified against its marker first.

Example::

    result = export_checkpoint(ExportRequest("ckpt", "model.safetensors", "safetensors"))
    result.step, result.tensors     # 300, 52
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..config import CHECKPOINT_VERIFY_MODES
from ..errors import UsageError
from ..extras import pip_install_hint
from .layout import MARKER, CheckpointDir, find_latest
from .safe_load import CheckpointRefused, WeightsOnlyLoadPlanner, check_dcp_metadata
from .verify import check

log = logging.getLogger("slipstream.checkpoint")

FORMATS = ("safetensors", "torch")
MODEL_PATH = ("model_optimizer", "model")  # where the layouts register the model (train/bookkeeping.py)
# Module names that only wrappers use (torch.compile, activation checkpointing, FSDP1): never a
# user's own. The state-dict API already leaves them out; a checkpoint written otherwise may not.
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_STEP_NAME = re.compile(r"^step_(\d{8,})$")


class ExportError(UsageError):
    """A checkpoint that cannot be exported, or an output that may not be written (exit 2)."""


@dataclass(frozen=True)
class ExportRequest:
    """What ``slipstream export`` was asked: ``checkpoint`` is a checkpoint directory (its newest
    complete step is taken) or one ``step_N`` directory; ``fmt`` one of :data:`FORMATS`."""

    checkpoint: str
    out: str
    fmt: str = "safetensors"
    force: bool = False
    verify: str = "full"  # checkpoint_verify's modes: full (sizes and checksums), size, off


@dataclass(frozen=True)
class ExportResult:
    source: str  # the step directory read
    step: int
    out: str
    tensors: int
    bytes: int


def resolve_checkpoint(path: str) -> CheckpointDir:
    """The step directory ``path`` names: itself when it holds the ``COMMITTED`` marker,
    else the newest complete checkpoint under it. :class:`ExportError` when there is none.

    Example::

        resolve_checkpoint("ckpt").path          # "ckpt/step_00000300"
        resolve_checkpoint("ckpt/step_00000200")  # that one
    """
    if not os.path.isdir(path):
        raise ExportError(f"no checkpoint at {path}: not a directory")
    if os.path.isfile(os.path.join(path, MARKER)):
        match = _STEP_NAME.match(os.path.basename(os.path.normpath(path)))
        step = int(match.group(1)) if match else _marker_step(path)
        return CheckpointDir(path, step)
    latest = find_latest(path)
    if latest is not None:
        return latest
    if os.path.isfile(os.path.join(path, ".metadata")):
        raise ExportError(f"{path} holds DCP files but no {MARKER} marker: an unfinished checkpoint "
                          "(a .partial directory), or not one written by slipstream")
    raise ExportError(f"no checkpoint at {path}: expected a checkpoint directory with complete "
                      f"step_NNNNNNNN/ directories, or one of them")


def _marker_step(path: str) -> int:
    try:
        return int(CheckpointDir(path, -1).info.get("step", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        return -1


def read_model_state(step_dir: str) -> dict[str, Any]:
    """The model's entries of the checkpoint in ``step_dir``, as ``{original name: value}``:
    full tensors on the CPU (shards put together), no optimizer state. Reads in this process
    alone, also in one that has a process group (no collective).

    Example::

        state = read_model_state("ckpt/step_00000300")
        model.load_state_dict(state, strict=True)
    """
    check_dcp_metadata(step_dir)  # refuses a .metadata that would run code when unpickled
    metadata = FileSystemReader(step_dir).read_metadata()
    planner_data = metadata.planner_data or {}
    model: dict[str, Any] = {}
    for key, meta in metadata.state_dict_metadata.items():
        path = tuple(planner_data.get(key, ()))
        if len(path) != len(MODEL_PATH) + 1 or path[: len(MODEL_PATH)] != MODEL_PATH:
            continue
        if isinstance(meta, TensorStorageMetadata):
            model[str(path[-1])] = torch.empty(meta.size, dtype=meta.properties.dtype)
        elif isinstance(meta, BytesStorageMetadata):
            model[str(path[-1])] = None  # replaced by the stored value
    if not model:
        raise ExportError(f"{step_dir} is not a slipstream training checkpoint: its DCP metadata holds no "
                          f"{'.'.join(MODEL_PATH)} entries")
    state = {MODEL_PATH[0]: {MODEL_PATH[1]: model}}  # nested as it was saved
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, checkpoint_id=step_dir, planner=WeightsOnlyLoadPlanner(), no_dist=True)
        except CheckpointException as exc:  # as safe_load.dcp_load: a refusal is raised as itself
            refused = [f[0] for f in exc.failures.values() if isinstance(f[0], CheckpointRefused)]
            if refused:
                raise refused[0] from None
            raise
    return strip_wrapper_prefixes(state[MODEL_PATH[0]][MODEL_PATH[1]])


def strip_wrapper_prefixes(state: dict[str, Any]) -> dict[str, Any]:
    """Names as the plain module has them: without the parts only wrappers add, and without
    DDP's ``module.`` when every name has it.

    Example::

        strip_wrapper_prefixes({"module._orig_mod.fc.weight": w})   # {"fc.weight": w}
    """
    names = {}
    for name in state:
        plain = name
        for part in _WRAPPER_PARTS:
            plain = plain.replace(part, "")
        names[name] = plain
    if names and all(n.startswith("module.") for n in names.values()):
        names = {k: v[len("module."):] for k, v in names.items()}
    out: dict[str, Any] = {}
    for name, plain in names.items():
        if plain in out:
            raise ExportError(f"checkpoint entries {name!r} and another one both become {plain!r} "
                              "once wrapper prefixes are removed")
        out[plain] = state[name]
    return out


def export_checkpoint(request: ExportRequest) -> ExportResult:
    """Write the model weights of ``request.checkpoint`` to ``request.out`` (see the module docstring).

    Example::

        export_checkpoint(ExportRequest("ckpt/step_00000300", "gpt.pt", "torch", force=True))
    """
    if request.fmt not in FORMATS:
        raise ExportError(f"unknown format {request.fmt!r}: choose one of {', '.join(FORMATS)}")
    if request.verify not in CHECKPOINT_VERIFY_MODES:
        raise ExportError(f"verify must be one of {', '.join(CHECKPOINT_VERIFY_MODES)}, got {request.verify!r}")
    if os.path.isdir(request.out):
        raise ExportError(f"output {request.out} is a directory: give a file name")
    if os.path.exists(request.out) and not request.force:
        raise ExportError(f"output {request.out} exists: pass --force to replace it")
    save_file = _safetensors_writer() if request.fmt == "safetensors" else None  # fail before reading
    ckpt = resolve_checkpoint(request.checkpoint)
    verdict = check(ckpt, request.verify)
    if verdict.failed:
        raise ExportError(f"checkpoint {ckpt.path} failed verification (--verify {request.verify}): {verdict.reason}")
    state = read_model_state(ckpt.path)
    if save_file is not None:
        others = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor))
        if others:
            raise ExportError(f"model entry {others[0]!r} is not a tensor and safetensors holds tensors only: "
                              "use --format torch")
    parent = os.path.dirname(os.path.abspath(request.out))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{request.out}.tmp-{os.getpid()}"
    try:
        if save_file is not None:
            tensors = {k: v.contiguous() for k, v in state.items()}
            save_file(tensors, tmp, metadata={"format": "pt", "slipstream_step": str(ckpt.step)})
        else:
            torch.save(state, tmp)
        os.replace(tmp, request.out)  # never a half-written file under the name asked for
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    log.info("exported %d tensors of %s (step %d) to %s", len(tensors), ckpt.path, ckpt.step, request.out)
    return ExportResult(source=ckpt.path, step=ckpt.step, out=request.out, tensors=len(tensors),
                        bytes=sum(t.numel() * t.element_size() for t in tensors))


def _safetensors_writer():  # noqa: ANN202 - safetensors.torch.save_file
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ExportError("--format safetensors needs the safetensors package: "
                          f"{pip_install_hint('export')} (or use --format torch)") from None
    return save_file
