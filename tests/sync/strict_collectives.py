"""A strict wrapper of torch.distributed's collectives for CPU tests: the rule of
which group and device every collective uses, checked on every call.

On GPUs NCCL refuses CPU tensors, and gloo does not; so a CPU test cannot see
a host-side figure sent on a group that inherits the training backend. This
wrapper makes that visible. It patches ``dist.new_group`` to learn how each
group was made, and the collectives to check each call:

* a group made with ``backend="gloo"`` on purpose (the sync control group,
  the checkpoint groups) is a *host group*: CPU tensors only;
* any other group (the default group, and groups that inherit its backend:
  NCCL on GPUs) is a *data group*: tensors on the data device only, and never
  float64, the dtype of every host-side figure in Slipstream (agreements,
  votes, probe results). On GPUs that vector would be a CPU tensor on NCCL;
  here it is the same bug, made visible;
* every group a collective runs on carries the configured timeout.

Violations are collected, not raised (the engine catches and reports some
exceptions itself); the test reads ``violations`` at the end.

Example::

    strict = StrictCollectives(data_device=torch.device("cpu"), timeout_s=123).install()
    ...                                   # run the engine
    assert strict.violations == []
"""

from __future__ import annotations

import datetime
import traceback
from typing import Any

import torch
import torch.distributed as dist

# Every collective a Python caller reaches through ``torch.distributed``. (torch's own
# object collectives call the tensor ones inside its module, unseen: they are checked
# at the object call, for the group.)
_COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter", "all_to_all_single",
    "reduce", "gather", "scatter", "barrier", "monitored_barrier", "broadcast_object_list",
    "all_gather_object", "gather_object", "scatter_object_list",
)


def group_timeout_of(group: Any) -> datetime.timedelta | None:
    """The timeout a (gloo) process group's backend was made with, or None if unreadable."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # noqa: BLE001 - another backend: not readable here
        return None


class StrictCollectives:
    def __init__(self, data_device: torch.device, timeout_s: float) -> None:
        self.data_device = torch.device(data_device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.host_groups: set[int] = set()
        self.violations: list[str] = []
        self.calls: list[tuple[str, str, str, str]] = []  # (function, "host"/"data", device, dtype)
        self._originals: dict[str, Any] = {}

    def install(self) -> StrictCollectives:
        original_new_group = dist.new_group
        self._originals["new_group"] = original_new_group

        def new_group(*args: Any, **kwargs: Any) -> Any:
            group = original_new_group(*args, **kwargs)
            if kwargs.get("backend") == "gloo" and group is not None:
                self.host_groups.add(id(group))
            return group

        dist.new_group = new_group
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._originals[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()

    def _wrap(self, name: str, fn: Any) -> Any:
        def checked(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
            self._check(name, group, tensors)
            return fn(*args, **kwargs)

        checked.__wrapped__ = fn  # type: ignore[attr-defined]
        return checked

    def _check(self, name: str, group: Any, tensors: list[torch.Tensor]) -> None:
        host = group is not None and id(group) in self.host_groups
        where = "".join(traceback.format_stack(limit=6)[:-2])
        for t in tensors:
            self.calls.append((name, "host" if host else "data", str(t.device), str(t.dtype)))
            if host and t.device.type != "cpu":
                self.violations.append(f"{name} on a host (gloo) group with a tensor on {t.device}\n{where}")
            if not host and t.device != self.data_device:
                self.violations.append(f"{name} on a data group with a tensor on {t.device} "
                                       f"(data device {self.data_device})\n{where}")
            if not host and t.dtype == torch.float64:
                self.violations.append(f"{name} on a data group with a float64 host-side figure "
                                       f"(shape {tuple(t.shape)}): on NCCL this is a CPU tensor\n{where}")
        timeout = group_timeout_of(group)
        if timeout is not None and timeout != self.timeout:
            self.violations.append(f"{name} on a group whose timeout is {timeout}, not the configured "
                                   f"{self.timeout}\n{where}")


__all__ = ["StrictCollectives", "group_timeout_of"]
