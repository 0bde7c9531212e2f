from __future__ import annotations

import json

import pytest

from tests.harness import free_port, run_ranks


def spawn(fn_name: str, world: int, local_world: int, tmp_path, env: dict | None = None) -> dict:
    """Run ``_workers.<fn_name>`` on ``world`` ranks, ``local_world`` per emulated node; its JSON results."""
    from tests.sync import _workers

    out = str(tmp_path / f"{fn_name}.json")
    run_ranks(
        getattr(_workers, fn_name), world, free_port(), out, local_world,
        env=env, local_world_size=local_world, timeout_s=900,
    )
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def suite_results(tmp_path_factory):
    return spawn("suite", 2, 2, tmp_path_factory.mktemp("suite"))


@pytest.fixture(scope="session")
def hierarchy_results(tmp_path_factory):
    return spawn("hierarchy", 4, 2, tmp_path_factory.mktemp("hier"))
