"""Optimizers and schedulers as given, or built from factories, over a layout's parameters.

Layouts that shard or split the model replace its parameters; the optimizer
must then hold the new ones (:func:`rebuild_optimizer`). Shared by the layouts
and :func:`slipstream.accelerate`.

Example::

    opt = build_optimizer(lambda params: torch.optim.AdamW(params, lr=3e-4), model.parameters())
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, Union

import torch
from torch import nn

from ..errors import ConfigError

OptimizerArg = Union[torch.optim.Optimizer, Callable[[Any], torch.optim.Optimizer]]
"""An optimizer, or a factory ``params -> optimizer``."""


def build_optimizer(optimizer: OptimizerArg, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """``optimizer`` as given, or built by the factory given over ``params``.

    Example::

        build_optimizer(lambda p: torch.optim.SGD(p, lr=0.1), model.parameters())
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    built = optimizer(params)
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(f"the optimizer factory must return a torch.optim.Optimizer, got {type(built).__name__}")
    return built


def build_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """A scheduler as given, or built by the factory given (a callable without ``step``).

    Example::

        build_scheduler(lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10), optimizer)
    """
    if scheduler is None or hasattr(scheduler, "step"):
        return scheduler
    if callable(scheduler):
        return scheduler(optimizer)
    raise ConfigError(f"scheduler must have step() or be a factory optimizer -> scheduler, got {type(scheduler).__name__}")


def foreign_parameters(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """How many of the optimizer's parameters are not the model's (0 when all are)."""
    owned = {id(p) for p in model.parameters()}
    return sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in owned)


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter, by ``id`` (a tied weight has several)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer, names: dict[int, list[str]], module: nn.Module
) -> torch.optim.Optimizer:
    """The same optimizer class and per-group hyperparameters over ``module``'s new parameters.

    ``names``: :func:`parameter_names` of the model the optimizer was built over.

    Example::

        names = parameter_names(model)
        layout = parallelize(model, ...)
        optimizer = rebuild_optimizer(optimizer, names, layout.module)
    """
    if any(optimizer.state.values()):
        raise ConfigError(
            "the optimizer has state already (it has stepped): on layouts that shard or split the model pass "
            "a fresh optimizer or a factory, e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)"
        )
    new = dict(module.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        # A tied weight has several names; a pipeline stage may hold it under its second one only.
        params: list[nn.Parameter] = []
        for p in group["params"]:
            held = [n for n in names.get(id(p), []) if n in new]
            if held and not any(q is new[held[0]] for q in params):
                params.append(new[held[0]])
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if not groups:
        raise ConfigError("the optimizer holds none of this rank's parameters")
    return _same_kind(optimizer, groups)


def _same_kind(optimizer: torch.optim.Optimizer, groups: list[dict], **changes: Any) -> torch.optim.Optimizer:
    # Constructor arguments from the defaults it accepts (AdamW's defaults hold
    # internal keys such as decoupled_weight_decay that its __init__ does not take).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    kwargs = {k: v for k, v in {**optimizer.defaults, **changes}.items() if k in accepted and k != "params"}
    return type(optimizer)(groups, **kwargs)


def _fused_kernel(optimizer: torch.optim.Optimizer) -> str | None:
    """The ``aten`` op torch's fused implementation of this optimizer calls, or None when
    it is not one of torch's (a third-party optimizer decides for itself)."""
    kinds = {cls.__name__ for cls in type(optimizer).__mro__ if cls.__module__.startswith("torch.optim")}
    if "AdamW" in kinds or ("Adam" in kinds and any(g.get("decoupled_weight_decay") for g in optimizer.param_groups)):
        return "_fused_adamw_"
    for name, op in (("Adam", "_fused_adam_"), ("SGD", "_fused_sgd_"), ("Adagrad", "_fused_adagrad_")):
        if name in kinds:
            return op
    return None


def dtensor_lacks_fused_rule(optimizer: torch.optim.Optimizer) -> str | None:
    """``aten.<op>`` when the optimizer is fused, holds DTensor parameters, and DTensor has
    no sharding rule for its fused kernel (torch 2.13: ``_fused_sgd_``, ``_fused_adagrad_``;
    fused Adam and AdamW have one); else None.

    Example::

        dtensor_lacks_fused_rule(torch.optim.SGD(model.parameters(), lr=0.1))   # None: not fused
    """
    if not any(g.get("fused") for g in optimizer.param_groups):
        return None
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
        return None
    name = _fused_kernel(optimizer)
    packet = getattr(torch.ops.aten, name, None) if name else None
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    if packet is None or propagator is None:
        return None  # nothing to look up: the first step shows what torch does
    registries = [getattr(propagator, r, {}) for r in ("op_strategy_funcs", "op_single_dim_strategy_funcs",
                                                         "op_to_rules")]
    overloads = [getattr(packet, o) for o in packet.overloads()]
    return None if any(op in r for r in registries for op in overloads) else f"aten.{name}"


def without_unsupported_fused(optimizer: torch.optim.Optimizer, where: str) -> tuple[torch.optim.Optimizer, str | None]:
    """``optimizer`` as is, or, when DTensor cannot run its fused kernel
    (:func:`dtensor_lacks_fused_rule`), the same optimizer with ``fused=False`` (torch then
    takes its foreach implementation on a GPU: the same update, one kernel per op instead
    of one in all) and the one line that says so. Only before its first step.

    Example::

        optimizer, note = without_unsupported_fused(optimizer, "tp(2)")
    """
    op = dtensor_lacks_fused_rule(optimizer)
    if op is None:
        return optimizer, None
    if any(optimizer.state.values()):
        raise ConfigError(f"{type(optimizer).__name__}(fused=True) on {where}: torch has no DTensor rule for {op}, "
                          "and the optimizer has stepped already: pass a fresh one with fused=False")
    groups = [{**g, "fused": False, "foreach": None} for g in optimizer.param_groups]
    rebuilt = _same_kind(optimizer, groups, fused=False, foreach=None)
    note = (f"optimizer {type(optimizer).__name__}(fused=True) on {where}: torch has no DTensor rule for {op}, "
            "so it runs unfused (foreach on GPUs): the same update")
    return rebuilt, note
