"""The control wire refuses what only a GPU run could hand it (issue #42).

On the CPU every tensor is a host tensor, so a figure computed on the training
device reaches ``ControlWire`` on the host by accident; on a GPU it would be a
device tensor on a gloo group (a host copy per call, or a crash on gloo's
coalesced paths). The meta device stands for the GPU: the refusal must come
before any collective, naming the device; a NCCL control group is refused too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from slipstream.sync.control import ControlWire


def test_a_device_tensor_is_refused_before_any_collective(monkeypatch):
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("a collective ran on a device tensor"))
    wire = ControlWire(None)
    wire.size = 2  # as in a two-rank run: the refusal must not depend on having peers
    with pytest.raises(ValueError, match="control collectives take CPU tensors .* got one on meta"):
        wire.allreduce(torch.zeros(3, device="meta"))
    assert wire.collectives == 0


def test_a_nccl_control_group_is_refused(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(ValueError, match="the control group must be a gloo group .* got backend 'nccl'"):
        ControlWire(object())
