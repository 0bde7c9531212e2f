"""A strict wrapper of torch.distributed's collectives for CPU tests: the rule of
which group and device every collective uses, checked on every call.

On GPUs NCCL refuses CPU tensors, and gloo does not; so a CPU test cannot see
a host-side figure sent on a group that inherits the training backend. This
wrapper makes that visible. It learns how each group was made (it patches
``new_group``, reading ``backend`` by keyword or position) and checks every
collective, whichever way it is reached:

* the ``torch.distributed`` functions (``dist.all_reduce`` ...), with the group
  and the tensors bound by the function's signature, so a group passed by
  position is seen like one passed by keyword;
* the ``ProcessGroup`` methods (``pg.allreduce([t])``, ``pg.broadcast`` ...),
  called directly; the calls torch's own functions make into them are not
  checked twice.

The rule:

* a group made with ``backend="gloo"`` on purpose (the sync control group,
  the checkpoint groups) is a *host group*: CPU tensors only, and no tensor
  that lives on the training device (see placements below);
* any other group (the default group, and groups that inherit its backend:
  NCCL on GPUs) is a *data group*: tensors on the data device only, never
  float64 (the dtype of Slipstream's host-side figures), and never a tensor
  the host built (see placements below);
* every group a collective runs on carries the configured timeout.

**Placements: the device rule on a machine with one device.** On the CPU
every tensor is on ``cpu``, so a device comparison can never fire. The
wrapper therefore follows, for each tensor, where it *would* live on a GPU,
with a :class:`~torch.overrides.TorchFunctionMode` that tags every tensor
torch's Python API returns (``t._strict_place``):

* ``host``: built by a factory with no device (``torch.tensor([...])``,
  ``torch.zeros(3)``: the default device is the CPU on GPU machines too), or
  with ``device="cpu"`` as a string, or moved by ``.cpu()`` / ``.to("cpu")``;
* ``device``: a ``nn.Parameter`` (the trained model lives on the device), a
  DDP gradient bucket's buffer, gradients and parameters (patched
  ``GradBucket`` methods), or moved by ``.cuda()``;
* ``any``: placed with an explicit ``torch.device`` object (``device=x.device``,
  ``.to(rt.device)``): on the CPU ``rt.device`` and ``torch.device("cpu")``
  are the same value, so such a tensor is not judged;
* anything else takes its inputs' placement as a GPU would: ``device`` if any
  input is on the device (a 0-dim CPU tensor mixed with CUDA ones gives CUDA),
  else ``any`` if any input is ``any``, else ``host``.

A ``host`` tensor on a data group is a violation (on NCCL it is a CPU
tensor: the bug this wrapper exists for, whatever its dtype); so is a
``device`` tensor on a host group (on GPUs a CUDA tensor on gloo). Untagged
tensors (made before :meth:`StrictCollectives.install`, or in a thread the
mode does not reach, such as a future's callback) are not judged by
placement. The rule gives no false alarm on correct code; it can miss a
figure built where the mode does not reach.

Violations are collected, not raised (the engine catches and reports some
exceptions itself); the test reads ``violations`` at the end. The checks on
this checker are in ``tests/sync/test_strict_collectives.py``.

Example::

    strict = StrictCollectives(data_device=torch.device("cpu"), timeout_s=123).install()
    ...                                   # run the engine
    strict.uninstall()
    assert strict.violations == []
"""

from __future__ import annotations

import datetime
import functools
import inspect
import threading
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode

# Every collective a Python caller reaches through ``torch.distributed``. (torch's own
# object collectives call the tensor ones inside its module and the ProcessGroup
# methods: they are checked at the object call, for the group.)
_COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "all_to_all_single",
    "all_to_all", "reduce", "gather", "scatter", "barrier", "monitored_barrier", "send", "recv",
    "isend", "irecv", "broadcast_object_list", "all_gather_object", "gather_object",
    "scatter_object_list",
)

# The ProcessGroup methods that move tensors (or synchronise), called as pg.name(...).
_PG_METHODS = (
    "allreduce", "allreduce_coalesced", "broadcast", "allgather", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "_allgather_base", "all_gather_single",
    "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
    "all_to_all_single", "reduce", "gather", "scatter", "barrier", "monitored_barrier", "send", "recv",
    "recv_anysource",
)

HOST, DEVICE, ANY = "host", "device", "any"
_TAG = "_strict_place"
_MISSING = object()


def group_timeout_of(group: Any) -> datetime.timedelta | None:
    """The timeout a (gloo) process group's backend was made with, or None if unreadable."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - another backend: not readable here
        return None


def placement(t: torch.Tensor) -> str | None:
    """Where ``t`` would live on a GPU machine (``host``, ``device``, ``any``), or None if untold."""
    if isinstance(t, torch.nn.Parameter):
        return DEVICE
    return getattr(t, _TAG, None)


def _tag(out: Any, place: str) -> None:
    if isinstance(out, torch.Tensor):
        if not isinstance(out, torch.nn.Parameter):
            try:
                setattr(out, _TAG, place)
            except (AttributeError, RuntimeError):
                pass
    elif isinstance(out, (list, tuple)):
        for o in out:
            if isinstance(o, torch.Tensor):
                _tag(o, place)


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among ``values``, looking two levels into lists, tuples and dicts."""
    out: list[torch.Tensor] = []

    def walk(v: Any, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif depth < 2 and isinstance(v, (list, tuple)):
            for x in v:
                walk(x, depth + 1)
        elif depth < 2 and isinstance(v, dict):
            for x in v.values():
                walk(x, depth + 1)

    walk(values, 0)
    return out


def _place_of_device_arg(device: Any) -> str | None:
    if device is None:
        return None
    if isinstance(device, str):
        return HOST if device == "cpu" else DEVICE if device.startswith("cuda") else ANY
    return ANY  # a torch.device (rt.device, x.device): on the CPU not told apart from "cpu"


def _place_of_to(args: tuple, kwargs: dict) -> str | None:
    """The placement ``Tensor.to(...)`` gives, or None when it only changes the dtype."""
    for a in list(args[1:]) + [kwargs.get("device"), kwargs.get("other")]:
        if isinstance(a, torch.Tensor):
            return placement(a) or ANY
        if isinstance(a, (str, torch.device)):
            return _place_of_device_arg(a)
    return None


class _Placements(TorchFunctionMode):
    """Tags what every torch function returns with where it would live on a GPU (module docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward:
            # torch runs a function with the mode off; the backward runs Python code
            # (DDP's comm hooks): keep the placements on for it.
            b = _BACKWARD_ARGS(*args, **kwargs).arguments
            with _Placements():
                return torch.autograd.backward(b["self"], b.get("gradient"), b.get("retain_graph"),
                                               b.get("create_graph", False), inputs=b.get("inputs"))
        out = func(*args, **kwargs)
        if not isinstance(out, (torch.Tensor, list, tuple)):
            return out
        if func is torch.tensor and kwargs.get("device") is None:
            place: str | None = HOST  # a CPU tensor, even of device tensors' values
        elif func is torch.Tensor.cpu:
            place = HOST
        elif func is torch.Tensor.cuda:
            place = DEVICE
        elif func is torch.Tensor.to and _place_of_to(args, kwargs) is not None:
            place = _place_of_to(args, kwargs)
        elif kwargs.get("device") is not None:
            place = _place_of_device_arg(kwargs["device"])
        else:
            inputs = _tensors(args) + _tensors(kwargs)
            if not inputs:
                place = HOST  # a factory on the default device: the CPU, on GPU machines too
            else:
                places = {placement(t) for t in inputs}
                place = DEVICE if DEVICE in places else ANY if ANY in places else HOST if places == {HOST} else None
        if place is not None:
            if (isinstance(out, torch.Tensor) and not isinstance(out, torch.nn.Parameter)
                    and any(out is a for a in args) and placement(out) != place):
                # A move to where the tensor already is (``.cpu()``, ``.to(dev)`` on the CPU)
                # returns the tensor itself; the GPU gives a new one. Tag a view, so the
                # original keeps its placement.
                try:
                    out = out.view_as(out)
                except RuntimeError:
                    pass
            _tag(out, place)
        return out


_BACKWARD_ARGS = inspect.signature(torch.Tensor.backward).bind


def _in_every_thread(boot: Any) -> Any:
    """``Thread._bootstrap_inner`` that runs the thread under the placements too (the mode
    stack is per thread; the sync engine works on its own)."""

    def bootstrap(thread: Any) -> None:
        with _Placements():
            boot(thread)

    bootstrap.__wrapped__ = boot  # type: ignore[attr-defined]
    return bootstrap


def _hooks_under_placements(register: Any) -> Any:
    """``DistributedDataParallel.register_comm_hook`` whose hook runs under the placements:
    the autograd engine runs hooks with the caller's modes off."""

    def register_comm_hook(ddp: Any, state: Any, hook: Any) -> Any:
        @functools.wraps(hook)
        def placed(state: Any, bucket: Any) -> Any:
            with _Placements():
                return hook(state, bucket)

        return register(ddp, state, placed)

    register_comm_hook.__wrapped__ = register  # type: ignore[attr-defined]
    return register_comm_hook


def _bucket_method(fn: Any) -> Any:
    def tagged(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(self, *args, **kwargs)
        _tag(out, DEVICE)
        return out

    tagged.__wrapped__ = fn  # type: ignore[attr-defined]
    return tagged


class StrictCollectives:
    def __init__(self, data_device: torch.device, timeout_s: float) -> None:
        self.data_device = torch.device(data_device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.host_groups: set[int] = set()
        self._host_group_refs: list[Any] = []  # keeps ids from being reused while installed
        self.violations: list[str] = []
        # (function, "host"/"data" group, device, dtype, placement or "untold")
        self.calls: list[tuple[str, str, str, str, str]] = []
        self._originals: list[tuple[Any, str, Any]] = []  # (owner, name, original)
        self._inside = threading.local()
        self._mode: _Placements | None = None

    # -- installing ------------------------------------------------------------------------

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        # The raw attribute, not getattr's: on a pybind class getattr gives the unbound
        # function, which set back would no longer bind ``self``.
        self._originals.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, new)

    def install(self) -> StrictCollectives:
        original_new_group = c10d.new_group
        bind_new_group = inspect.signature(original_new_group).bind

        def new_group(*args: Any, **kwargs: Any) -> Any:
            group = original_new_group(*args, **kwargs)
            try:
                backend = bind_new_group(*args, **kwargs).arguments.get("backend")
            except TypeError:
                backend = kwargs.get("backend")
            if backend is not None and str(backend).lower() == "gloo" and group is not None:
                self.host_groups.add(id(group))
                self._host_group_refs.append(group)
            return group

        new_group.__wrapped__ = original_new_group  # type: ignore[attr-defined]
        self._patch(dist, "new_group", new_group)
        self._patch(c10d, "new_group", new_group)
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._patch(dist, name, self._wrap(name, fn))
        for name in _PG_METHODS:
            fn = getattr(dist.ProcessGroup, name, None)
            if fn is not None:
                self._patch(dist.ProcessGroup, name, self._wrap_method(name, fn))
        for name in ("buffer", "gradients", "parameters"):
            fn = getattr(dist.GradBucket, name, None)
            if fn is not None:
                self._patch(dist.GradBucket, name, _bucket_method(fn))
        self._patch(DDP, "register_comm_hook", _hooks_under_placements(DDP.register_comm_hook))
        self._patch(threading.Thread, "_bootstrap_inner", _in_every_thread(threading.Thread._bootstrap_inner))
        self._mode = _Placements()
        self._mode.__enter__()
        return self

    def uninstall(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for owner, name, fn in reversed(self._originals):
            if fn is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)
        self._originals.clear()
        self._host_group_refs.clear()

    # -- wrapping ----------------------------------------------------------------------------

    def _outermost(self) -> bool:
        return getattr(self._inside, "depth", 0) == 0

    def _call(self, fn: Any, args: tuple, kwargs: dict) -> Any:
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            self._inside.depth -= 1

    def _wrap(self, name: str, fn: Any) -> Any:
        try:
            bind = inspect.signature(fn).bind
        except (TypeError, ValueError):
            bind = None

        def checked(*args: Any, **kwargs: Any) -> Any:
            if self._outermost():
                group, values = kwargs.get("group"), list(args) + list(kwargs.values())
                if bind is not None:
                    try:
                        bound = bind(*args, **kwargs).arguments
                        group = bound.get("group")
                        values = [v for k, v in bound.items() if k != "group"]
                    except TypeError:
                        pass
                self._check(f"dist.{name}", group, _tensors(values))
            return self._call(fn, args, kwargs)

        checked.__wrapped__ = fn  # type: ignore[attr-defined]
        return checked

    def _wrap_method(self, name: str, fn: Any) -> Any:
        def checked(pg: Any, *args: Any, **kwargs: Any) -> Any:
            if self._outermost():
                self._check(f"ProcessGroup.{name}", pg, _tensors(list(args) + list(kwargs.values())))
            return self._call(fn, (pg, *args), kwargs)

        checked.__wrapped__ = fn  # type: ignore[attr-defined]
        return checked

    # -- the rule ------------------------------------------------------------------------------

    def _check(self, name: str, group: Any, tensors: list[torch.Tensor]) -> None:
        host = group is not None and id(group) in self.host_groups
        where = "".join(traceback.format_stack(limit=7)[:-3])
        for t in tensors:
            place = placement(t)
            self.calls.append((name, "host" if host else "data", str(t.device), str(t.dtype), place or "untold"))
            if host and t.device.type != "cpu":
                self.violations.append(f"{name} on a host (gloo) group with a tensor on {t.device}\n{where}")
            if host and place == DEVICE:
                self.violations.append(f"{name} on a host (gloo) group with a tensor from the training device "
                                       f"(shape {tuple(t.shape)}, {t.dtype}): on GPUs a CUDA tensor on gloo\n{where}")
            if not host and t.device != self.data_device:
                self.violations.append(f"{name} on a data group with a tensor on {t.device} "
                                       f"(data device {self.data_device})\n{where}")
            if not host and t.dtype == torch.float64:
                self.violations.append(f"{name} on a data group with a float64 host-side figure "
                                       f"(shape {tuple(t.shape)}): on NCCL this is a CPU tensor\n{where}")
            elif not host and place == HOST:
                self.violations.append(f"{name} on a data group with a tensor the host built "
                                       f"(shape {tuple(t.shape)}, {t.dtype}): on NCCL this is a CPU tensor\n{where}")
        timeout = group_timeout_of(group)
        if timeout is not None and timeout != self.timeout:
            self.violations.append(f"{name} on a group whose timeout is {timeout}, not the configured "
                                   f"{self.timeout}\n{where}")


__all__ = ["ANY", "DEVICE", "HOST", "StrictCollectives", "group_timeout_of", "placement"]
