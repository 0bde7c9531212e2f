"""Fixtures of the checkpoint tests."""

from __future__ import annotations

import pytest

from slipstream.checkpoint.lease import Lease


@pytest.fixture(autouse=True)
def _no_lease_heartbeat_outlives_its_test(monkeypatch):
    """Many tests here drop a CheckpointManager without close() (a process that dies, a
    refused load): its lease heartbeat thread would go on writing to a deleted tmp
    directory or to the session's S3 server for the rest of the suite. Each lease a
    test takes is released when the test ends."""
    taken: list[Lease] = []
    acquire = Lease.acquire

    def acquire_and_remember(self: Lease) -> None:
        acquire(self)
        taken.append(self)

    monkeypatch.setattr(Lease, "acquire", acquire_and_remember)
    yield
    for lease in taken:
        lease.release()
