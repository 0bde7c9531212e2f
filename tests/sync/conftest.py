from __future__ import annotations

import json
import os
import socket
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn_name: str, world: int, local_world: int, tmp_path, env: dict | None = None) -> dict:
    import _workers
    import torch.multiprocessing as mp

    out = str(tmp_path / f"{fn_name}.json")
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        mp.spawn(getattr(_workers, fn_name), args=(world, free_port(), out, local_world), nprocs=world, join=True)
    finally:
        os.environ.clear()
        os.environ.update(old)
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def suite_results(tmp_path_factory):
    return spawn("suite", 2, 2, tmp_path_factory.mktemp("suite"))


@pytest.fixture(scope="session")
def hierarchy_results(tmp_path_factory):
    return spawn("hierarchy", 4, 2, tmp_path_factory.mktemp("hier"))
