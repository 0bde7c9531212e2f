"""Parameters the tensor-parallel plan does not shard, replicated on the tp mesh.

Why: on CUDA torch's optimizers take their foreach implementation by default
(fused when asked), and a foreach or fused kernel refuses a list that mixes
DTensors with plain tensors (``aten._foreach_mul_.Scalar: got mixed
torch.Tensor and DTensor``; the first GPU run crashed there at its first step).
Under tensor parallelism the plan shards some Linear layers, while embeddings,
norms and a tied head stay whole. Here each of those becomes a DTensor on the
tp mesh with a ``Replicate`` placement, as torchtitan keeps every parameter on
the mesh: clipping, every optimizer implementation and checkpoints then see one
kind of tensor, and FSDP2 over ``dp_shard x tp`` shards all of them onto one
2-D mesh.

The forward is unchanged. While a module that owns such a parameter runs (and
while the root module runs, for code that reads another module's weight, such
as a head tied by hand), the attribute reads the parameter's local tensor
(``to_local()``: no communication, every tp rank holds the whole value). So the
arithmetic is the plain tensors' arithmetic, bit for bit, and the gradient
flows back into the parameter as a Replicate DTensor. The local tensor is put in
the module's instance ``__dict__``, which Python reads before ``nn.Module``'s
``__getattr__`` looks in ``_parameters``; ``parameters()``, ``state_dict()``
and FSDP2 keep seeing the DTensor. It is taken away when the module returns (or
raises), and read afresh at each call: under FSDP2 the parameter object that
holds the gathered value changes from one forward to the next.

Example::

    apply_tensor_parallel(model, dims.tp_mesh, plan)
    replicate_unsharded(model, dims.tp_mesh)     # every parameter is now a DTensor on the tp mesh
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh


class _Slot:
    """One (module, attribute) that names a replicated parameter, and how many running
    forwards (the owner's, the root's) currently hold its local view."""

    __slots__ = ("module", "name", "holders")

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module = module
        self.name = name
        self.holders = 0


def _replicated(param: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(param, DTensor) and all(p.is_replicate() for p in param.placements)


class _LocalViews:
    """Forward hooks that show ``slots`` as local tensors while a module runs.

    Re-entrant (a module called inside itself, a checkpointed block recomputed
    in backward): each call counts the slots it made visible and the view is
    removed when the last holder returns.
    """

    def __init__(self, slots: list[_Slot]) -> None:
        self.slots = slots
        self._frames: list[list[_Slot]] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        held = []
        for slot in self.slots:
            param = slot.module._parameters.get(slot.name)
            # Only a replicated value can be read whole; a parameter FSDP2 holds
            # sharded at this moment (another unit's, before that unit runs) is left
            # alone and fails loudly if read, as it would under FSDP2 itself.
            if _replicated(param):
                slot.module.__dict__[slot.name] = param.to_local()
                slot.holders += 1
                held.append(slot)
        self._frames.append(held)

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        for slot in self._frames.pop() if self._frames else ():
            slot.holders -= 1
            if slot.holders == 0:
                slot.module.__dict__.pop(slot.name, None)


def replicate_unsharded(model: nn.Module, tp_mesh: DeviceMesh) -> int:
    """Make every parameter of ``model`` that is not yet a DTensor a Replicate DTensor on
    ``tp_mesh``, in place, ties kept (one new parameter per original, set wherever the
    original was). Returns how many parameters were replicated.

    Values come from the mesh's first rank (``distribute_tensor`` broadcasts, as the
    plan's sharded layers are scattered from it), so every tp rank starts equal.
    A collective over ``tp_mesh``: every rank of it calls this with the same model.
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    replaced: dict[int, nn.Parameter] = {}
    slots: dict[int, list[_Slot]] = {}
    owners: dict[int, nn.Module] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            new = replaced.get(id(param))
            if new is None:
                value = distribute_tensor(param.detach(), tp_mesh, [Replicate()])
                new = nn.Parameter(value, requires_grad=param.requires_grad)
                replaced[id(param)] = new
            module.register_parameter(name, new)
            slots.setdefault(id(module), []).append(_Slot(module, name))
            owners[id(module)] = module
    if not replaced:
        return 0
    every = [slot for group in slots.values() for slot in group]
    _hook(model, every)
    for key, group in slots.items():
        if owners[key] is not model:
            _hook(owners[key], group)
    return len(replaced)


def _hook(module: nn.Module, slots: list[_Slot]) -> None:
    views = _LocalViews(slots)
    module.register_forward_pre_hook(views.enter)
    module.register_forward_hook(views.leave, always_call=True)
