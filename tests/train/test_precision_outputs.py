"""outputs_to_fp32 keeps every container's type: low-precision floats come back fp32, nothing else changes.

No process group: the function is pure. The real transformers ``ModelOutput`` is
checked in tests/train/test_hf.py (which needs transformers); here a stand-in of
the same shape (an OrderedDict that is also a dataclass, items and attributes in step).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import torch

from slipstream.train.precision import outputs_to_fp32

BF16 = torch.ones(2, 3, dtype=torch.bfloat16)
FP16 = torch.ones(2, dtype=torch.float16)
IDS = torch.arange(4)


@dataclasses.dataclass
class Output(OrderedDict):
    """Like transformers' ModelOutput: keys are the fields that are not None."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: Any = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __getitem__(self, key: Any) -> Any:
        return list(self.values())[key] if isinstance(key, int) else super().__getitem__(key)


@dataclasses.dataclass(frozen=True)
class Frozen:
    logits: torch.Tensor
    ids: torch.Tensor
    note: str = "x"
    derived: int = dataclasses.field(init=False, default=7)


Pair = namedtuple("Pair", "logits ids")


class Tagged(list):
    tag = "kept"


def test_tensors():
    assert outputs_to_fp32(BF16).dtype == torch.float32
    assert outputs_to_fp32(FP16).dtype == torch.float32
    same = torch.ones(2)
    assert outputs_to_fp32(same) is same
    assert outputs_to_fp32(IDS) is IDS  # integers untouched
    assert outputs_to_fp32(torch.ones(2, dtype=torch.float64)).dtype == torch.float64
    x = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    outputs_to_fp32(x * 2).sum().backward()  # the cast is differentiable
    assert x.grad is not None and x.grad.dtype == torch.bfloat16


def test_model_output_like_keeps_its_type_attributes_and_indexing():
    loss = torch.tensor(1.5)
    out = outputs_to_fp32(Output(loss=loss, logits=BF16))
    assert type(out) is Output
    assert list(out.keys()) == ["loss", "logits"] and out.hidden is None
    assert out.loss is loss and out[0] is loss  # fp32 tensors are not copied
    assert out.logits.dtype == torch.float32 and out["logits"] is out.logits and out[1] is out.logits
    original = Output(logits=BF16)
    outputs_to_fp32(original)
    assert original.logits.dtype == torch.bfloat16  # the model's own output is not modified


def test_namedtuples_and_torch_return_types():
    out = outputs_to_fp32(Pair(BF16, IDS))
    assert type(out) is Pair and out.logits.dtype == torch.float32 and out.ids is IDS
    top = outputs_to_fp32(torch.max(BF16, dim=1))
    assert type(top) is torch.return_types.max
    assert top.values.dtype == torch.float32 and top.indices.dtype == torch.long


def test_dataclasses():
    out = outputs_to_fp32(Frozen(BF16, IDS, note="n"))
    assert type(out) is Frozen and out.logits.dtype == torch.float32 and out.ids is IDS
    assert out.note == "n" and out.derived == 7


def test_plain_and_subclassed_containers_nested():
    nested = {"a": [BF16, (FP16, IDS)], "b": Pair(BF16, None), "c": "text", "d": None}
    out = outputs_to_fp32(nested)
    assert type(out) is dict and list(out) == ["a", "b", "c", "d"]
    assert type(out["a"]) is list and type(out["a"][1]) is tuple and type(out["b"]) is Pair
    assert out["a"][0].dtype == out["a"][1][0].dtype == out["b"].logits.dtype == torch.float32
    assert out["a"][1][1] is IDS and out["c"] == "text" and out["d"] is None
    ordered = outputs_to_fp32(OrderedDict(x=BF16, y=IDS))
    assert type(ordered) is OrderedDict and ordered["x"].dtype == torch.float32
    default = defaultdict(list, x=BF16)
    out_default = outputs_to_fp32(default)
    assert type(out_default) is defaultdict and out_default.default_factory is list
    tagged = outputs_to_fp32(Tagged([BF16, IDS]))
    assert type(tagged) is Tagged and tagged[0].dtype == torch.float32 and tagged.tag == "kept"


def test_fp32_outputs_come_back_as_the_same_objects():
    # Every forward goes through this in every precision: at fp32 it must copy nothing.
    for value in (Output(loss=torch.tensor(1.0), logits=torch.ones(2)), {"a": [torch.ones(1), (IDS,)]},
                  Pair(torch.ones(1), IDS), Frozen(torch.ones(1), IDS), Tagged([IDS]), "text", None, 3):
        assert outputs_to_fp32(value) is value
