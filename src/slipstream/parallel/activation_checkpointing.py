"""Activation checkpointing of chosen module types, on torch's checkpoint wrapper.

The wrapped modules keep their state_dict keys (torch's wrapper strips its own
prefix), so checkpoints stay compatible with the unwrapped model.
"""

from __future__ import annotations

import functools

from torch import nn

from ..errors import ConfigError


def apply_activation_checkpointing(model: nn.Module, type_names: tuple[str, ...]) -> int:
    """Recompute activations of every submodule whose class name is in ``type_names``.

    Returns how many modules were wrapped.

    Example::

        apply_activation_checkpointing(gpt, ("Block",))
    """
    if not type_names:
        return 0
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing as _apply,
        checkpoint_wrapper,
    )

    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in type_names if name not in present]
    if missing:
        raise ConfigError(
            f"activation_checkpointing: no module of type {', '.join(missing)} in the model; "
            f"types present: {', '.join(sorted(present))}"
        )
    wanted = set(type_names)
    count = sum(1 for m in model.modules() if type(m).__name__ in wanted)
    _apply(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: type(m).__name__ in wanted,
    )
    return count
