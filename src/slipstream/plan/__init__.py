"""Cost model, simulator and planner: predict step time, memory and cost of a layout; rank layouts.

Modules: :mod:`.specs` (GPUs and models), :mod:`.network` (links, network SPEC),
:mod:`.costmodel` (equations and the per-bucket simulator), :mod:`.calibrate`
(measure this machine), :mod:`.planner` (enumerate and rank), :mod:`.cli`
(``slipstream plan``). The equations and their validation are in docs/plan.md.

Example::

    from slipstream.plan import plan
    result = plan("gpt-7b", gpus=8, gpu_type="H100", network="400gbit-ib")
    result.best.layout.label(), result.best.time_to_train_s
"""

from __future__ import annotations

from typing import Any


def plan(*args: Any, **kwargs: Any):
    """See :func:`slipstream.plan.planner.plan`."""
    from .planner import plan as _plan

    return _plan(*args, **kwargs)


__all__ = ["plan"]
