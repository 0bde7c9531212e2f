"""What the model's front module needs at forward time, shared by every layout.

:class:`MicroSteps` counts micro-steps and says whether the coming backward
synchronises; :class:`ForwardContext` bundles it with the recorder and the
heartbeat reporter, so a wrapper gets everything in its constructor;
:func:`count_inputs` is the one place that counts samples and tokens.

Example::

    micro = MicroSteps(accumulate_steps=4)
    micro.syncs          # False: the first of four micro-steps accumulates locally
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..fault.progress import ProgressReporter
from ..metrics import StepRecorder


class MicroSteps:
    """Which micro-step we are in; decides whether this backward synchronises."""

    def __init__(self, accumulate_steps: int) -> None:
        self.accumulate_steps = accumulate_steps
        self.index = 0  # micro-steps done since the last optimizer step
        self.total = 0  # micro-steps done since the start of training (resumed from checkpoints)
        # Samples this rank fed the model in the window so far, and in the last whole optimizer step
        # (None until one ended): the batch a checkpoint records, to tell a resumed run that changed it.
        self.window_samples = 0
        self.step_samples: int | None = None

    @property
    def syncs(self) -> bool:
        """True on the last micro-step of an accumulation window.

        Only that one all-reduces: the earlier ones just add into the local
        gradient, which is exact because the all-reduce is linear.
        """
        return self.index == self.accumulate_steps - 1


@dataclass(frozen=True)
class ForwardContext:
    """Everything a layout's front module (``run.model``) reads at forward time."""

    micro: MicroSteps
    recorder: StepRecorder
    progress: ProgressReporter | None
    """Heartbeats for hang diagnosis (None on one rank)."""
    device: torch.device


def count_inputs(recorder: StepRecorder, args: tuple[Any, ...], kwargs: dict[str, Any],
                 micro: MicroSteps | None = None) -> None:
    """Count the batch of one forward: samples from the batch tensor's first
    dimension, and tokens when it holds token ids (integer, ``(batch, seq)``).
    The samples also go to ``micro``'s window when given.

    The batch tensor is the first positional argument; for a Hugging Face style
    call (``model(**batch)``, or a dict passed whole) it is ``input_ids``, else
    the first tensor among the keyword arguments (the dict's values).

    Example::

        count_inputs(recorder, (torch.zeros(8, 128, dtype=torch.long),), {})   # 8 samples, 1024 tokens
        count_inputs(recorder, (), {"input_ids": ids, "attention_mask": mask, "labels": ids})  # same
    """
    first = _batch_tensor(args[0]) if args else None
    if first is None:
        first = _batch_tensor(kwargs)
    if first is not None and first.dim() >= 1:
        recorder.add_samples(first.shape[0])
        if micro is not None:
            micro.window_samples += first.shape[0]
        if first.dim() >= 2 and not first.is_floating_point():
            recorder.add_tokens(first.numel())


def _batch_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, Mapping):
        ids = value.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids
        value = next((v for v in value.values() if isinstance(v, torch.Tensor)), None)
    return value if isinstance(value, torch.Tensor) else None
