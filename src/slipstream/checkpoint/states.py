"""Stateful adapters for what a training run checkpoints."""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


class ModelOptimizerState:
    """Model and optimizer through torch's distributed state-dict API, which
    handles DDP and FSDP2/DTensor parameters and initialises lazy optimizer state.

    ``optimizer_names`` (optional) renames parameters in the optimizer's state:
    a pipeline stage that holds a tied weight under its second name (the GPT's
    last stage has ``head.weight`` without ``tok.weight``) saves and loads its
    optimizer state under the name the whole model uses (``tok.weight``), so
    checkpoints move between layouts.
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, optimizer_names: dict[str, str] | None = None
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.optimizer_names = dict(optimizer_names or {})

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": _rename(optim_sd, self.optimizer_names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        back = {new: old for old, new in self.optimizer_names.items()}
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"],
            optim_state_dict=_rename(state["optimizer"], back),
        )


def _rename(osd: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """Rename parameters in an optimizer state dict keyed by names ({"state": {fqn: ...},
    "param_groups": [{"params": [fqn, ...], ...}]}, as get_state_dict returns it)."""
    if not names:
        return osd
    out = dict(osd)
    out["state"] = {names.get(k, k): v for k, v in osd.get("state", {}).items()}
    out["param_groups"] = [
        {**g, "params": [names.get(p, p) for p in g["params"]]} for g in osd.get("param_groups", [])
    ]
    return out


class RNGState:
    """Python, numpy, torch CPU and CUDA generator states of this rank."""

    def state_dict(self) -> dict[str, Any]:
        state = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class CallbackState:
    """State given as two functions (for counters that live elsewhere)."""

    def __init__(self, get: Callable[[], dict[str, Any]], put: Callable[[dict[str, Any]], None]) -> None:
        self._get, self._put = get, put

    def state_dict(self) -> dict[str, Any]:
        return self._get()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._put(state)
