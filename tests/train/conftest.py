"""Fixtures shared by the training tests."""

from __future__ import annotations

import signal

import pytest

import slipstream


@pytest.fixture()
def single_process():
    """A one-process group for the test, then shut down. The checkpoint manager installs a SIGTERM
    handler in this (pytest's) main thread: the previous one is put back after."""
    previous = signal.getsignal(signal.SIGTERM)
    slipstream.init()
    yield
    slipstream.shutdown()
    signal.signal(signal.SIGTERM, previous)
