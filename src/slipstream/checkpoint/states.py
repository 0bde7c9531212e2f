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
    handles DDP (and FSDP) wrappers and initialises lazy optimizer state."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )


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
