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

The checkpoint may be in an object store (an fsspec URL, ``s3://bucket/run1``:
:mod:`.remote`), read in place: the newest prefix holding the ``COMMITTED``
marker is taken (one without it is an upload cut short, ignored as resume
ignores it), with credentials and endpoint from the environment as for
training (``AWS_*``, ``FSSPEC_S3_*``) or ``ExportRequest.storage_options``.

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
from typing import Any, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..config import CHECKPOINT_VERIFY_MODES
from ..errors import SlipstreamError, UsageError
from ..extras import pip_install_hint
from . import remote
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
    # fsspec options when ``checkpoint`` is a URL (default: the environment's, AWS_* and FSSPEC_S3_*)
    storage_options: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ExportResult:
    source: str  # the step directory read
    step: int
    out: str
    tensors: int
    bytes: int


def resolve_checkpoint(path: str, storage_options: Mapping[str, Any] | None = None) -> CheckpointDir:
    """The step directory ``path`` names: itself when it holds the ``COMMITTED`` marker,
    else the newest complete checkpoint under it. :class:`ExportError` when there is none.
    ``path`` may be an fsspec URL (its ``storage_options``): then the result carries its ``fs``.

    Example::

        resolve_checkpoint("ckpt").path          # "ckpt/step_00000300"
        resolve_checkpoint("ckpt/step_00000200")  # that one
        resolve_checkpoint("s3://bucket/run1")    # s3://bucket/run1/step_00000300, read in place
    """
    path = remote.local_path(path)
    if remote.is_url(path):
        return _resolve_url(path.rstrip("/"), storage_options)
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


def _resolve_url(url: str, storage_options: Mapping[str, Any] | None) -> CheckpointDir:
    """As :func:`resolve_checkpoint`, in an object store: a prefix is complete when it holds
    the marker (there is no ``.partial`` there: a ``step_N/`` without it is debris)."""
    fs = remote.one_shot_filesystem(url, storage_options, what="CHECKPOINT")
    found = _store_call(url, remote.objects, fs, url)  # one listing; a missing bucket lists as empty
    if MARKER in found:
        match = _STEP_NAME.match(url.rsplit("/", 1)[-1])
        return CheckpointDir(url, int(match.group(1)) if match else _marker_step(url, fs), fs)
    latest = _store_call(url, find_latest, url, fs)
    if latest is not None:
        return latest
    if ".metadata" in found:
        raise ExportError(f"{url} holds DCP files but no {MARKER} marker: an upload cut short (or still "
                          "being written), or not one written by slipstream")
    unmarked = sorted({rel.partition("/")[0] for rel in found if _STEP_NAME.match(rel.partition("/")[0])})
    if unmarked:
        raise ExportError(f"no complete checkpoint at {url}: {', '.join(unmarked)} "
                          f"{'has' if len(unmarked) == 1 else 'have'} no {MARKER} marker (uploads cut short, "
                          "or still being written)")
    if not found:
        bucket = _store_call(url, remote.missing_bucket, fs, url)
        if bucket is not None:
            raise ExportError(f"no checkpoint at {url}: bucket {bucket!r} does not exist")
        raise ExportError(f"no checkpoint at {url}: nothing is stored under that prefix")
    raise ExportError(f"no checkpoint at {url}: expected complete step_NNNNNNNN/ prefixes, or one of them")


def _store_call(url: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)``; a store client's error (network, credentials, permissions: botocore's are
    not OSErrors) becomes one :class:`ExportError` naming ``url``."""
    try:
        return fn(*args)
    except SlipstreamError:
        raise
    except Exception as exc:  # noqa: BLE001 - any client's error: its type and first line are shown
        raise ExportError(f"cannot read {url}: {_store_problem(exc)}") from None


def _store_problem(exc: BaseException) -> str:
    name = type(exc).__name__
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    if name == "NoCredentialsError":
        hint = ("give credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, "
                "or an instance role")
    elif name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError"):
        hint = "is the endpoint right (AWS_ENDPOINT_URL, FSSPEC_S3_ENDPOINT_URL) and reachable?"
    else:
        return f"{name}: {text}"
    return f"{name}: {text} ({hint})"


def _marker_step(path: str, fs: Any = None) -> int:
    try:
        return int(CheckpointDir(path, -1, fs).info.get("step", -1))
    except (OSError, ValueError, TypeError, AttributeError):
        return -1


def read_model_state(step_dir: str, storage_options: Mapping[str, Any] | None = None,
                     fs: Any = None) -> dict[str, Any]:
    """The model's entries of the checkpoint in ``step_dir`` (a directory, or an fsspec URL
    read with ``storage_options``; ``fs``: its filesystem, if made already), as
    ``{original name: value}``: full tensors on the CPU (shards put together), no optimizer
    state. Reads in this process alone, also in one that has a process group (no collective).

    Example::

        state = read_model_state("ckpt/step_00000300")
        model.load_state_dict(state, strict=True)
    """
    step_dir = remote.local_path(step_dir)
    if remote.is_url(step_dir):
        fs = fs if fs is not None else remote.one_shot_filesystem(step_dir, storage_options, what="CHECKPOINT")
        reader = remote.dcp_reader(step_dir, remote.one_shot_options(step_dir, storage_options))
    else:
        fs, reader = None, FileSystemReader(step_dir)
    check_dcp_metadata(step_dir, fs)  # refuses a .metadata that would run code when unpickled
    metadata = _store_call(step_dir, reader.read_metadata) if fs is not None else reader.read_metadata()
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
            dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), no_dist=True)
        except CheckpointException as exc:  # as safe_load.dcp_load: a refusal is raised as itself
            refused = [f[0] for f in exc.failures.values() if isinstance(f[0], CheckpointRefused)]
            if refused:
                raise refused[0] from None
            failure = next(iter(exc.failures.values()))[0]
            raise ExportError(f"reading {step_dir} failed: {_store_problem(failure)}") from None
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
    ckpt = resolve_checkpoint(request.checkpoint, request.storage_options)
    verdict = check(ckpt, request.verify) if ckpt.fs is None else _store_call(ckpt.path, check, ckpt, request.verify)
    if verdict.failed:
        raise ExportError(f"checkpoint {ckpt.path} failed verification (--verify {request.verify}): {verdict.reason}")
    state = read_model_state(ckpt.path, request.storage_options, ckpt.fs)
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
