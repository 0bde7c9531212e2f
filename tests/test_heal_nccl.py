"""Healing in place on NCCL: the two calls that differ from gloo, in order, with torch faked (issue #42).

NCCL cannot put two ranks on one GPU and no machine here has two, so this path runs
nowhere here. What the CPU suite can check is the call order torch documents: a
survivor aborts the broken NCCL communicators (``_abort_process_group``: a NCCL
collective that lost its peer never returns, and destroying the group would wait on
it) where gloo destroys the group, and a generation's NCCL group is bound to the
rank's GPU (``device_id``) where gloo's is not.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from slipstream.resilience import heal


@pytest.fixture
def calls(monkeypatch):
    log: list = []
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda group=None: log.append(("abort", group)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: log.append(("destroy", group)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: log.append(("init", backend, kw)))
    monkeypatch.setattr(heal.Healer, "_init_fake_group", lambda self: log.append(("fake",)))
    return log


def _healer(backend: str) -> heal.Healer:
    return heal.Healer(dist.HashStore(), "t", 1, 2, backend, datetime.timedelta(seconds=5),
                       device=torch.device("cuda", 1) if backend == "nccl" else torch.device("cpu"))


@pytest.mark.parametrize(("backend", "ends"), [("nccl", ("abort", None)), ("gloo", ("destroy", None))])
def test_a_survivor_leaves_the_broken_group_then_takes_the_fake_one(calls, backend, ends):
    h = _healer(backend)
    h.generation = 3  # in generation 3's group when a peer died
    h.leave()
    assert calls == [ends, ("fake",)]
    assert h.pending and h._left == 3
    h.leave()  # already left: nothing more to tear down
    assert len(calls) == 2


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_generations_group_is_bound_to_the_ranks_gpu_on_nccl_only(calls, backend):
    h = _healer(backend)
    h._init_group(4)
    (kind, got_backend, kw), = calls
    assert (kind, got_backend) == ("init", backend)
    assert kw["device_id"] == (torch.device("cuda", 1) if backend == "nccl" else None)
    assert (kw["rank"], kw["world_size"]) == (1, 2) and kw["timeout"] == datetime.timedelta(seconds=5)
