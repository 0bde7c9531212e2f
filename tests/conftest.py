"""Shared pytest fixtures and CI conventions.

Root-only tests (network namespaces, tc) are marked ``root``: outside CI they
skip when not root; in CI (CI=true) they must run, so they fail instead.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_root(reason: str = "needs root (network namespaces / tc)") -> None:
    """Call at the start of a root-only test: skip locally, fail loudly in CI."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail(f"{reason}, and CI=true: root-only tests must run in CI")
        pytest.skip(reason)


@pytest.fixture(autouse=True)
def _submission_records_stay_in_the_test(tmp_path_factory, monkeypatch):
    """`slipstream submit` records jobs under ~/.local/state; no test writes to the user's home."""
    if "SLIPSTREAM_STATE_DIR" not in os.environ:
        monkeypatch.setenv("SLIPSTREAM_STATE_DIR", str(tmp_path_factory.mktemp("submissions")))
