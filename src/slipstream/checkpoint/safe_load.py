"""Reading checkpoint files without running what they hold.

A checkpoint directory may come from anywhere (a shared volume, an object
store), and a pickle runs code when it is loaded. Per-rank files are read with
``torch.load(weights_only=True)``: tensors, numbers, strings, None, and lists,
tuples and dicts of them; anything else is refused, naming the file. For the
same reason :func:`dcp_load` checks DCP's ``.metadata`` (a plain pickle) against
DCP's metadata types and loads DCP's non-tensor values weights_only.

Tensors saved from a GPU come back on this rank's device (which may have
another index than when saved, or be the CPU); CPU tensors (RNG states) stay
on the CPU.

Example::

    state = load_rank_file("ckpt/step_100/rank0.pt", torch.device("cuda", 0))
"""

from __future__ import annotations

import enum
import io
import logging
import os
import pickle
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import ConfigError
from ..process import runtime

log = logging.getLogger("slipstream.checkpoint")


class CheckpointRefused(ConfigError):
    """A checkpoint file that is unreadable or holds more than plain data (exit 2)."""


def _legacy_numpy_globals() -> list[Any]:
    """What RNG states written before this format need: numpy's ``get_state()``
    tuple holds a uint32 ndarray, pickled through these. Under both of numpy's
    module names (``numpy.core`` before 2.0, ``numpy._core`` after)."""
    reconstruct = np.ndarray.__reduce__(np.zeros(1, np.uint32))[0]  # numpy's _reconstruct, wherever it lives
    allowed: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), reconstruct]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed.append((reconstruct, f"{module}._reconstruct"))
    return allowed


def _legacy_numpy_names() -> set[str]:
    names = set()
    for item in _legacy_numpy_globals():
        if isinstance(item, tuple):
            names.add(item[1])
        else:
            names.add(f"{item.__module__}.{item.__qualname__}")
    return names


def default_device() -> torch.device:
    """This rank's device: the one :func:`slipstream.init` chose, else the current
    CUDA device when CUDA is in use, else the CPU.

    Example::

        default_device()   # device(type='cpu') on a machine without a GPU
    """
    rt = runtime.started()
    if rt is not None:
        return rt.device
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def restore_location(device: torch.device | Callable[[], torch.device]) -> Callable[[Any, str], Any]:
    """A ``map_location`` for ``torch.load``: storages saved on a GPU go to ``device``
    (a GPU of this rank, whatever index they had, or the CPU); CPU storages stay.

    ``device`` may be a function, asked only when a GPU storage turns up (so a
    file of CPU tensors never touches CUDA).

    Example::

        torch.load(path, map_location=restore_location(torch.device("cuda", 1)), weights_only=True)
    """

    def location(storage: Any, saved_at: str) -> Any:
        if not saved_at.startswith("cuda"):
            return storage
        target = device() if callable(device) else device
        if target.type != "cuda":
            return storage  # deserialised on the CPU already
        return torch.serialization.default_restore_location(storage, str(target))

    return location


def load_rank_file(path: str, device: torch.device | Callable[[], torch.device] | None = None,
                   data: bytes | None = None) -> dict[str, Any]:
    """A per-rank checkpoint file as plain data; refuses pickled objects with :class:`CheckpointRefused`.
    ``data``: the file's bytes, already read (an object store's); ``path`` then only names it.

    Files written before the RNG state stopped holding numpy arrays load too:
    numpy's ndarray reconstruction is the only extra type they may use.

    Example::

        per_rank = load_rank_file("ckpt/step_100/rank0.pt", torch.device("cpu"))
        per_rank["rng"]["torch"]   # a CPU ByteTensor
    """
    where = restore_location(device if device is not None else default_device)
    source: Callable[[], Any] = (lambda: path) if data is None else (lambda: io.BytesIO(data))
    try:
        return _load(source(), path, where)
    except CheckpointRefused:
        raise
    except pickle.UnpicklingError as exc:
        unsafe = _unsafe_globals(source())
        if unsafe and set(unsafe) <= _legacy_numpy_names():
            log.info("%s: per-rank state in the earlier format (numpy RNG state as an ndarray)", path)
            with torch.serialization.safe_globals(_legacy_numpy_globals()):
                return _load(source(), path, where)
        what = (f"pickled Python objects ({', '.join(unsafe)})" if unsafe
                else f"data that is not a plain tensor checkpoint ({_unpickler_reason(exc)})")
        raise CheckpointRefused(
            f"checkpoint file {path} holds {what}; refused: loading it could run code. "
            "Per-rank state must be tensors, numbers, strings and lists/tuples/dicts of them; "
            "delete the file (or the checkpoint) if you did not write it"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointRefused(f"checkpoint file {path} cannot be read: {_first_line(exc)}") from None


def _load(source: Any, path: str, where: Callable[[Any, str], Any]) -> dict[str, Any]:
    state = torch.load(source, map_location=where, weights_only=True)
    if not isinstance(state, dict):
        raise CheckpointRefused(f"checkpoint file {path} holds a {type(state).__name__}, not a dict of per-rank state")
    return state


def _unsafe_globals(source: Any) -> list[str]:
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(source))
    except Exception:  # noqa: BLE001 - not a zip checkpoint (a raw pickle): nothing to list
        return []


def _unpickler_reason(exc: BaseException) -> str:
    """The reason inside torch's long weights_only message (which suggests
    weights_only=False: not advice to pass on for a file of unknown origin)."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        rest = [line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()]
        if rest:
            return rest[0].split(" was not an allowed global")[0]  # the rest advises allowlisting it
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# What DCP's .metadata file (a plain pickle, which torch unpickles unrestricted)
# may name besides the classes of torch.distributed.checkpoint.metadata.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)  # torch.float32, torch.strided, ...


def _enum_member(cls: Any, name: Any) -> Any:
    """What ``builtins.getattr`` may do in a metadata pickle: name a member of one of DCP's
    metadata enums. CPython 3.11.0 to 3.11.4 (Debian 12's python3 is 3.11.2) pickle an enum
    member as ``getattr(EnumClass, "NAME")``; other versions by value."""
    if (isinstance(cls, type) and issubclass(cls, enum.Enum)
            and cls.__module__ == "torch.distributed.checkpoint.metadata"
            and isinstance(name, str) and name in cls.__members__):
        return cls[name]
    raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not a checkpoint metadata enum member")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch.distributed.checkpoint.metadata":
            found = super().find_class(module, name)
            if isinstance(found, type):  # dataclasses and enums; no functions
                return found
        elif (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a checkpoint metadata type")


def dcp_load(state: dict[str, Any], checkpoint_dir: str, process_group: Any = None,
             storage_reader: Any = None, fs: Any = None) -> None:
    """``dcp.load`` of ``state`` from ``checkpoint_dir`` as plain data: the metadata is
    checked first (on every rank, the outcome agreed: see :func:`agree_refusal`),
    non-tensor values load weights_only, and a refusal on any rank is raised on
    every rank as :class:`CheckpointRefused` (not inside DCP's CheckpointException).
    In an object store, ``storage_reader`` is DCP's fsspec reader and ``fs`` the filesystem.

    Example::

        dcp_load({"model": model}, "ckpt/step_100")
    """
    refusal = None
    try:
        check_dcp_metadata(checkpoint_dir, fs)  # each rank reads the file itself: it may differ (a node-local copy)
    except CheckpointRefused as exc:
        refusal = exc
    agree_refusal(refusal, process_group)  # before the collective: a rank refusing alone left the others in it
    where = {"checkpoint_id": checkpoint_dir} if storage_reader is None else {"storage_reader": storage_reader}
    try:
        dcp.load(state, **where, process_group=process_group, planner=WeightsOnlyLoadPlanner())
    except CheckpointException as exc:
        refused = [failure[0] for failure in exc.failures.values() if isinstance(failure[0], CheckpointRefused)]
        if refused:
            raise refused[0] from None
        raise


def agree_refusal(refusal: Exception | None, group: Any = None) -> None:
    """Every rank of ``group`` learns whether any rank failed a check of a checkpoint,
    and all of them raise the first failing rank's reason (``"rank R: ..."``): as
    :class:`CheckpointRefused` (exit 2) when that rank refused the file, else as
    ``OSError`` (exit 1: an object store's read error may pass, a restart may
    succeed). When none failed, it returns on every rank. Call it on every rank
    after a rank-local check and before a collective load: a rank that raised
    alone would leave the others in that load until the collective timeout.

    A collective on ``group`` (the checkpoint's gloo group: the reasons travel as CPU
    tensors); ``None``: the default group. Without a process group it raises
    ``refusal`` itself.

    Example::

        try:
            per_rank = load_rank_file(path)
        except CheckpointRefused as exc:
            refusal = exc
        agree_refusal(refusal, group)   # every rank raises, or none does
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if refusal is not None:
            raise refusal
        return
    mine = None if refusal is None else (isinstance(refusal, CheckpointRefused), str(refusal))
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    for rank, failure in enumerate(gathered):
        if failure is not None:
            refused, reason = failure
            global_rank = dist.get_global_rank(group, rank) if group is not None else rank
            message = reason if reason.startswith("rank ") else f"rank {global_rank}: {reason}"
            raise CheckpointRefused(message) if refused else OSError(message)


def check_dcp_metadata(checkpoint_dir: str, fs: Any = None) -> Any:
    """Refuse a DCP checkpoint whose ``.metadata`` names anything but DCP's metadata
    types (torch unpickles that file unrestricted); :class:`CheckpointRefused` names the file.
    Returns the metadata (DCP's ``Metadata``: ``state_dict_metadata`` names every entry).

    Example::

        check_dcp_metadata("ckpt/step_100")   # then dcp.load(...) reads it
    """
    path = os.path.join(checkpoint_dir, ".metadata")
    try:
        with open(path, "rb") if fs is None else fs.open(path, "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointRefused(
            f"checkpoint file {path} holds more than checkpoint metadata ({_first_line(exc)}); refused: "
            "loading it could run code. Delete the checkpoint if you did not write it"
        ) from None
    except (OSError, EOFError, ValueError, TypeError, AttributeError, ImportError) as exc:
        raise CheckpointRefused(f"checkpoint file {path} cannot be read: {_first_line(exc)}") from None


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor values (step counters, scaler and
    scheduler state) are unpickled ``weights_only``; torch 2.13's default unpickles
    them as arbitrary objects. Tensors are unchanged: DCP copies each into the
    registered tensor, on that tensor's device.

    Example::

        dcp.load(state, checkpoint_id=path, planner=WeightsOnlyLoadPlanner())
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointRefused(
                f"checkpoint entry {read_item.dest_index.fqn!r} holds a pickled Python object; refused: loading it "
                f"could run code ({_unpickler_reason(exc)})"
            ) from None
        # As DefaultLoadPlanner.load_bytes puts the value in place, with the safe load above.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
