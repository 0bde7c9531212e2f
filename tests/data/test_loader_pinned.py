"""The loader's pinned-memory path, taken on the CPU (issue #42).

``pin_memory=True`` only pins when torch sees an accelerator: on this CPU-only
machine torch skips the whole path (with a warning), so the suite never ran the
code a GPU run takes for every batch. Here torch is told an accelerator exists
(``torch.accelerator``), and ``Tensor.pin_memory`` is replaced by a copy that
remembers it was pinned (the real one needs a device). Every batch must come
back as the same type, with the same values, and with every tensor pinned: a
tensor left in pageable memory turns the training loop's
``.to(device, non_blocking=True)`` into a synchronous copy, which no CPU test
would notice and a GPU run only shows as a slower step.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils.data
from torch.utils.data import default_collate

from slipstream.data import SlipstreamLoader
from slipstream.data.loader import pin_batch


class Pinning:
    """What the fixture saw: batches the DataLoader sent to pinning, and the ids of pinned copies."""

    def __init__(self) -> None:
        self.batches = 0
        self.tensors: set[int] = set()


@pytest.fixture
def accelerator(monkeypatch):
    """torch as on a CUDA machine, as far as the data loader's pinning asks."""
    seen = Pinning()
    torch_pin = torch.utils.data._utils.pin_memory.pin_memory

    depth = threading.local()

    def pin_data(data: Any, device: Any = None) -> Any:  # what DataLoader calls on each batch
        outer = not getattr(depth, "n", 0)  # torch's walk calls this name again for what is inside
        seen.batches += outer
        depth.n = getattr(depth, "n", 0) + 1
        try:
            return torch_pin(data, device)
        finally:
            depth.n -= 1

    def pin(t: torch.Tensor, device: Any = None) -> torch.Tensor:
        copy = t.clone()
        seen.tensors.add(id(copy))
        return copy

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
    # The worker path's pin thread selects the device first.
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    monkeypatch.setattr(torch.utils.data._utils.pin_memory, "pin_memory", pin_data)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, device=None: id(t) in seen.tensors)
    return seen


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    source: str = "train"
    mask: torch.Tensor | None = dataclasses.field(default=None, init=False)  # set after construction

    def __post_init__(self) -> None:
        self.mask = self.y > 0


@dataclasses.dataclass(frozen=True)
class Frozen:
    tokens: torch.Tensor
    extra: dict


class Encoding(collections.UserDict):
    """Stands for transformers' BatchEncoding: a mapping that is not a dict."""


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int = 12) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.full((3,), float(i)), "y": torch.tensor(i % 4)}


def _dict(samples):
    return default_collate(samples)


def _namedtuple(samples):
    d = default_collate(samples)
    return Pair(d["x"], d["y"])


def _tuple_and_list(samples):
    d = default_collate(samples)
    return (d["x"], [d["y"], "labels"])


def _dataclass(samples):
    d = default_collate(samples)
    return Batch(d["x"], d["y"])


def _frozen_nested(samples):
    d = default_collate(samples)
    return {"batch": Frozen(d["x"], {"y": d["y"], "pair": Pair(d["x"], d["y"])}), "step": 3}


def _user_mapping(samples):
    d = default_collate(samples)
    return Encoding(input_ids=d["x"], labels=d["y"])


STRUCTURES = [_dict, _namedtuple, _tuple_and_list, _dataclass, _frozen_nested, _user_mapping]


def _leaves(value: Any, path: str = "batch"):
    """(path, tensor) of every tensor in ``value``, walking the containers this test builds."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), f"{path}.{f.name}")
    elif isinstance(value, collections.abc.Mapping):
        for k, v in value.items():
            yield from _leaves(v, f"{path}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{path}[{i}]")


def _same(a: Any, b: Any) -> bool:
    """Equal values in containers of the same types (tensors by value)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, collections.abc.Mapping):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _batches(collate, pin: bool, num_workers: int = 0) -> list:
    loader = SlipstreamLoader(Samples(), batch_size=4, shuffle=False, rank=0, world_size=1, pin_memory=pin,
                              collate_fn=collate, num_workers=num_workers)
    try:
        return list(loader)
    finally:
        loader.close()


@pytest.mark.parametrize("collate", STRUCTURES, ids=lambda f: f.__name__.strip("_"))
def test_pinned_batches_keep_their_type_values_and_are_pinned(accelerator, collate):
    plain = _batches(collate, pin=False)
    assert accelerator.batches == 0 and not accelerator.tensors, "pin_memory=False pinned something"
    pinned = _batches(collate, pin=True)
    assert accelerator.batches == 3, "the pinning path was not taken: the accelerator check was not forced"
    assert len(pinned) == len(plain) == 3
    for got, want in zip(pinned, plain):
        assert _same(got, want), f"pinning changed the batch: {got!r} against {want!r}"
        unpinned = [path for path, t in _leaves(got) if not t.is_pinned()]
        assert not unpinned, f"left in pageable memory: {unpinned}"


def test_the_worker_path_pins_in_its_pin_thread_too(accelerator):
    """num_workers > 0: torch pins in a thread of the training process, with the same function."""
    got = _batches(_frozen_nested, pin=True, num_workers=1)
    assert accelerator.batches == 3
    assert len(got) == 3 and _same(got[0], _batches(_frozen_nested, pin=False)[0])
    assert all(t.is_pinned() for b in got for _, t in _leaves(b))


def test_pin_batch_keeps_objects_it_does_not_know_and_uses_a_batchs_own_pin_memory(accelerator):
    class OwnPin:
        def __init__(self, t):
            self.t = t

        def pin_memory(self):
            return OwnPin(self.t.pin_memory())

    opaque = object()
    out = pin_batch({"own": OwnPin(torch.ones(2)), "opaque": opaque, "text": "abc", "n": 3})
    assert out["own"].t.is_pinned() and out["opaque"] is opaque and out["text"] == "abc" and out["n"] == 3
