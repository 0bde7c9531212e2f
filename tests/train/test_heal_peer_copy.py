"""Healing in place with the snapshots' peer copy on (issue #43 item 3): the copy no longer refuses
the heal (its group is formed again with the others; the node-loss run is
tests/integration/test_heal_node_loss.py)."""

from __future__ import annotations

from types import SimpleNamespace

from slipstream.train import healing
from slipstream.train.layout_dp import DataParallelLayout


def test_a_run_with_the_peer_copy_heals():
    snapshots = SimpleNamespace(enabled=True, peer=object())  # a peer copy: more than one node
    run = SimpleNamespace(checkpoints=SimpleNamespace(snapshots=snapshots),
                          layout=object.__new__(DataParallelLayout),
                          config=SimpleNamespace(sync=SimpleNamespace(strategy="allreduce")),
                          describe_layout=lambda: "dp")
    assert healing.heal_refusal(run) is None
