"""``--backend``, ``--device`` and ``--collective-timeout-s`` for a script that creates its own process group.

``slipstream.init()`` reads these flags (as ``SLIPSTREAM_BACKEND``, ``SLIPSTREAM_DEVICE``,
``SLIPSTREAM_COLLECTIVE_TIMEOUT_S``). A script that calls
``torch.distributed.init_process_group`` itself (torchrun style, or inside the Hugging
Face Trainer, Accelerate, Lightning) would never see them, so the worker entry wraps
``init_process_group`` when one is given:

* ``--collective-timeout-s``: applied, as the group's ``timeout`` (it replaces the
  script's, with a line saying so): hang detection then works as for ``init()``;
* ``--backend``: applied when the script leaves the backend to torch
  (``init_process_group()`` with none); a script that names another keeps it, since
  its tensors live where that backend expects them, and a line names the flag;
* ``--device``: named (one line): a script places its model itself.

Lines are printed by rank 0; a group created by ``slipstream.init()`` is left alone.

Example::

    install({"SLIPSTREAM_COLLECTIVE_TIMEOUT_S": "60"})   # in the worker, before the script runs
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..log import CONSOLE

log = logging.getLogger(__name__)

KEYS = ("SLIPSTREAM_BACKEND", "SLIPSTREAM_DEVICE", "SLIPSTREAM_COLLECTIVE_TIMEOUT_S")


def given(environ: Mapping[str, str]) -> bool:
    return any(environ.get(key) for key in KEYS)


def _timeout_s(raw: str) -> float | None:
    if not raw.strip():
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"SLIPSTREAM_COLLECTIVE_TIMEOUT_S must be a number of seconds > 0, got {raw!r}")
    return value


def install(environ: Mapping[str, str]) -> None:
    """Wrap ``torch.distributed.init_process_group`` for the flags in ``environ``."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.init_process_group
    if getattr(original, "_slipstream_flags", False):
        return
    from ..process.runtime import requested_placement

    # Checked as slipstream.init() checks them: a bad value set by hand is one line (ConfigError, exit 2).
    backend, device = requested_placement(environ)
    timeout_s = _timeout_s(environ.get("SLIPSTREAM_COLLECTIVE_TIMEOUT_S", ""))

    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("slipstream."):  # slipstream.init() read the flags itself
            return original(*args, **kwargs)
        lines = []
        bound = signature.bind(*args, **kwargs)
        theirs = bound.arguments.get("backend")
        if backend is not None:
            if theirs is None:
                bound.arguments["backend"] = backend
            elif str(theirs).lower() != backend:
                lines.append(f"--backend {backend} not applied: the script creates its process group with "
                             f"{theirs} (its tensors live where that backend expects them)")
        if timeout_s is not None:
            old = bound.arguments.get("timeout")
            if old is not None and old.total_seconds() != timeout_s:
                lines.append(f"--collective-timeout-s {timeout_s:g} replaces the script's timeout of "
                             f"{old.total_seconds():g} s")
            bound.arguments["timeout"] = datetime.timedelta(seconds=timeout_s)
        if device is not None:
            lines.append(f"--device {device} not applied: the script places its model itself "
                         "(slipstream.init() reads it)")
        if os.environ.get("RANK", "0") == "0":
            for line in lines:
                log.info(f"[slipstream] {line}", extra=CONSOLE)
        return original(*bound.args, **bound.kwargs)

    init_process_group._slipstream_flags = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group
