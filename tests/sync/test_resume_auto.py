"""State round trip and bitwise resume for every codec ``auto`` can choose, flat and hierarchical.

Results come from the 2-rank suite (``_workers.suite``, check ``roundtrip_auto``): a plan forced
onto each codec of ``compress.CODECS``; 8 steps straight against 5, a saved and reloaded state,
and 3 resumed steps. ``hierarchical+auto`` runs as 2 nodes of 1 rank, so the codec carries the
inter-node step.
"""

from __future__ import annotations

import pytest

from slipstream.sync.compress import CODECS

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("strategy", ("auto", "hierarchical+auto"))
@pytest.mark.parametrize("codec", CODECS)
def test_resume_from_state_is_bitwise(suite_results, strategy, codec):
    section = suite_results["roundtrip_auto"]
    assert "error" not in section, section.get("error")
    assert section["codecs"] == list(CODECS)
    r = section[f"{strategy}/{codec}"]
    assert r["mode"] == "run" and r["decision"] == f"{codec}:1", r  # the plan came back with the state
    assert r["steps"] == 8, r
    assert r["bitwise"], r
    if "fresh_state_diff" in r:  # error feedback: the check can fail without the codec state
        assert r["fresh_state_diff"] > 1e-4, r
