"""The Layout protocol's healing interface: every layout implements it, and the facade asks it."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from slipstream.train import healing
from slipstream.train.layout import Layout
from slipstream.train.layout_dp import DataParallelLayout
from slipstream.train.layout_mesh import MeshLayout

HEALING = ("heal_refusal", "release", "leave", "rejoined")


@pytest.mark.parametrize("layout", [DataParallelLayout, MeshLayout])
def test_every_layout_implements_the_healing_interface(layout):
    for name in HEALING:
        assert inspect.signature(getattr(layout, name)) == inspect.signature(getattr(Layout, name)), name


def test_the_mesh_layout_says_why_it_cannot_heal_pipeline_and_diloco():
    plain = SimpleNamespace(dims=SimpleNamespace(pp=1), sync=None)
    assert MeshLayout.heal_refusal(plain) is None  # type: ignore[arg-type]
    piped = SimpleNamespace(dims=SimpleNamespace(pp=2), sync=None)
    assert "pipeline parallelism (pp 2)" in MeshLayout.heal_refusal(piped)  # type: ignore[arg-type]
    replicas = SimpleNamespace(dims=SimpleNamespace(pp=1), sync=object())
    assert "diloco" in MeshLayout.heal_refusal(replicas)  # type: ignore[arg-type]


def test_the_facade_takes_the_layouts_refusal_and_heals_a_mesh_layout_that_can():
    snapshots = SimpleNamespace(enabled=True, peer=None)
    run = SimpleNamespace(layout=SimpleNamespace(heal_refusal=lambda: None),
                          config=SimpleNamespace(sync=SimpleNamespace(strategy="allreduce")),
                          checkpoints=SimpleNamespace(snapshots=snapshots))
    assert healing.heal_refusal(run) is None  # type: ignore[arg-type]
    run.layout = SimpleNamespace(heal_refusal=lambda: "the reason")
    assert healing.heal_refusal(run) == "the reason"  # type: ignore[arg-type]
