"""What a resumed run is told: how it differs from the checkpoint it went on from, and whether
there was anything left to train.

Each checkpoint's marker keeps a small record of the run that wrote it (:func:`describe`:
world size, the settings that change the arithmetic, the planned length, the batch); a
run that resumes compares its own with it and says what differs in one line
(:func:`differences`). The optimizer's hyperparameters are compared separately, before and
after the restore: torch's ``Optimizer.load_state_dict`` puts the saved ones back, so a
learning rate changed in the script is silently the old one unless someone says so.

Pure functions over plain data: :mod:`.facade` calls them and prints on rank 0.

Example::

    saved = describe(TrainConfig(precision="bf16"), world_size=2, dp_size=2, samples_per_step=8)
    differences(saved, describe(TrainConfig(precision="bf16"), 4, 4, 8))   # ["world size 2 -> 4"]
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..config import TrainConfig

RECORDED = ("precision", "accumulate_steps", "grad_clip_norm", "sync", "sync_options", "total_steps")
"""TrainConfig fields (flat names) a checkpoint records: those that change what a step computes,
and the planned length of the run."""


def describe(config: TrainConfig, world_size: int, dp_size: int, samples_per_step: int | None) -> dict[str, Any]:
    """The run as a checkpoint's marker records it (JSON)."""
    flat = config.flat()
    record: dict[str, Any] = {"world_size": world_size, "dp_size": dp_size, "samples_per_step": samples_per_step}
    record.update({name: flat[name] for name in RECORDED})
    # As the marker's JSON will hold it (a tuple in sync_options comes back a list), so that a record
    # read back and one made now compare equal; a value JSON cannot hold is kept as its text.
    return json.loads(json.dumps(record, default=str))


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the run that wrote a checkpoint and this one, in words
    (``samples_per_step`` aside: this run knows its batch after its first step, see :func:`batch_line`)."""
    out = []
    if saved.get("world_size") not in (None, now["world_size"]):
        out.append(f"world size {saved['world_size']} -> {now['world_size']}")
    for name in RECORDED:
        if name in saved and saved[name] != now[name]:
            out.append(f"{name} {_text(saved[name])} -> {_text(now[name])}")
    return out


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's numeric hyperparameters (lr, weight_decay, betas, ...): a scheduler's
    ``initial_lr`` stands for ``lr``, which the scheduler has already moved."""
    groups = []
    for group in optimizer.param_groups:
        values = {key: value for key, value in group.items()
                  if key not in ("params", "lr", "initial_lr") and _number_like(value)}
        lr = group.get("initial_lr", group.get("lr"))
        if _number_like(lr):
            values["lr"] = float(lr)
        groups.append(values)
    return groups


def hyperparameter_differences(script: list[dict[str, Any]], restored: list[dict[str, Any]]) -> list[str]:
    """The script's optimizer hyperparameters that the checkpoint's replaced."""
    out = []
    for index, (mine, theirs) in enumerate(zip(script, restored)):
        where = f" (group {index})" if len(script) > 1 else ""
        for key in sorted(set(mine) & set(theirs)):
            if _normal(mine[key]) != _normal(theirs[key]):
                out.append(f"{key}{where}: the script's {_text(mine[key])}, the checkpoint's {_text(theirs[key])} "
                           "is used")
    return out


def resumed_line(where: str, step: int, changes: list[str]) -> str:
    """The one line a resumed run prints; its changes, when any, in the same line."""
    line = f"[slipstream] resumed from {where} at step {step}"
    if changes:
        line += ("; this run differs from the one that wrote it: " + ", ".join(changes)
                 + " (the optimizer's state comes back with its hyperparameters, as torch restores them)"
                 * any(" is used" in change for change in changes))
    return line


def complete_line(where: str, step: int, total_steps: int | None) -> str:
    """What a run that had nothing left to train prints (exit 0, no step taken)."""
    if total_steps is not None:
        reached = f"it holds step {step} and total_steps is {total_steps}"
    else:
        reached = f"it holds step {step}, where this script's loop ends"
    return (f"[slipstream] nothing to train: the run in {where} is already complete ({reached}); to train "
            "again from scratch give another checkpoint_dir, to train further raise the loop's bound")


def batch_line(saved: int, now: int) -> str:
    """The batch changed (samples per rank per optimizer step, counted at this run's first step)."""
    return (f"[slipstream] the batch differs from the checkpoint's: {now} samples per rank per optimizer step "
            f"now, {saved} in the run that wrote it")


def _number_like(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (tuple, list)) and bool(value) and all(_number_like(v) for v in value)


def _normal(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return float(value.item())
    if isinstance(value, (tuple, list)):
        return tuple(_normal(v) for v in value)
    return float(value)


def _text(value: Any) -> str:
    value = _normal(value) if _number_like(value) else value
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_text(v) for v in value) + ")"
    return str(value)


__all__ = ["RECORDED", "batch_line", "complete_line", "describe", "differences", "hyperparameter_differences",
           "hyperparameters", "resumed_line"]
