"""visible_gpus() on a machine with GPUs, taken on the CPU (issue #42).

init() tells two ranks on one physical GPU apart only by the identities this
returns; the CPU suite replaced it everywhere. Here torch.cuda is a stand-in:
one identity per visible device, in CUDA index order, none without CUDA.
"""

from __future__ import annotations

import types

import torch

from slipstream.process.gpu_binding import visible_gpus


def test_one_identity_per_visible_gpu_in_index_order(monkeypatch):
    asked: list[int] = []

    def properties(i: int):
        asked.append(i)
        return types.SimpleNamespace(uuid=f"uuid-{7 - i}")  # identities unrelated to the index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    assert visible_gpus() == ("uuid-7", "uuid-6", "uuid-5")
    assert asked == [0, 1, 2]


def test_no_cuda_no_identities_and_no_device_query(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: (_ for _ in ()).throw(AssertionError(i)))
    assert visible_gpus() == ()
