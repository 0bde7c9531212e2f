"""A node cut off from the rendezvous store tries to join again, for up to its join timeout."""

from __future__ import annotations

import os

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from slipstream.launch import api
from slipstream.launch.api import LaunchOptions
from slipstream.resilience.snapshot_dirs import ENV_REJOINS


def _agent(failures: int):
    calls = []

    def run() -> None:
        calls.append(os.environ.get(ENV_REJOINS))
        if len(calls) <= failures:
            raise RendezvousConnectionError("The connection to the C10d store has failed.")

    return run, calls


def _opts(**kw) -> LaunchOptions:
    return LaunchOptions("train.py", min_nodes=1, max_nodes=2, rdzv_endpoint="10.0.0.1:29400", **kw)


def test_a_joining_node_tries_again_until_the_store_answers(monkeypatch, caplog):
    monkeypatch.setattr(api, "REJOIN_PAUSE_S", 0.0)
    monkeypatch.delenv(ENV_REJOINS, raising=False)  # restored after the test
    run, calls = _agent(failures=2)
    api._launch_rejoining(_opts(node_rank=1), "10.0.0.1:29400", run)
    # each new agent's workers learn the launcher ran workers before (their snapshots are kept)
    assert calls == [None, "1", "2"]
    assert "cannot reach the rendezvous store at 10.0.0.1:29400" in caplog.text and "check --rdzv-endpoint" in caplog.text


def test_it_gives_up_after_the_join_timeout(monkeypatch):
    monkeypatch.setattr(api, "REJOIN_PAUSE_S", 0.02)
    monkeypatch.delenv(ENV_REJOINS, raising=False)
    run, calls = _agent(failures=10**6)
    with pytest.raises(RendezvousConnectionError):
        api._launch_rejoining(_opts(node_rank=1, join_timeout_s=0.1), "10.0.0.1:29400", run)
    assert 2 <= len(calls) < 100


def test_the_rendezvous_host_does_not_retry(monkeypatch):
    monkeypatch.setattr(api, "REJOIN_PAUSE_S", 0.0)
    run, calls = _agent(failures=1)
    with pytest.raises(RendezvousConnectionError):
        api._launch_rejoining(_opts(node_rank=0), "10.0.0.1:29400", run)
    assert len(calls) == 1


def test_the_retry_window_is_capped_whatever_the_join_timeout(monkeypatch):
    """A lost rendezvous host takes the c10d store with it: the others must still fail within minutes."""
    monkeypatch.setattr(api, "REJOIN_PAUSE_S", 0.02)
    monkeypatch.setattr(api, "REJOIN_WINDOW_S", 0.1)
    monkeypatch.delenv(ENV_REJOINS, raising=False)
    run, calls = _agent(failures=10**6)
    with pytest.raises(RendezvousConnectionError):
        api._launch_rejoining(_opts(node_rank=1, join_timeout_s=600), "10.0.0.1:29400", run)
    assert 2 <= len(calls) < 100
