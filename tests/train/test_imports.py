"""The training facade's modules form no import cycle, and parallel never imports train."""

from __future__ import annotations

import itertools

import grimp


def test_train_modules_have_no_cycle_and_parallel_does_not_import_train():
    graph = grimp.build_graph("slipstream")
    modules = sorted(m for m in graph.modules if m.startswith("slipstream.train."))
    assert {"slipstream.train.facade", "slipstream.train.layout_dp", "slipstream.train.layout_mesh"} <= set(modules)
    cycles = [(a, b) for a, b in itertools.combinations(modules, 2)
              if graph.chain_exists(importer=a, imported=b) and graph.chain_exists(importer=b, imported=a)]
    assert cycles == []
    assert graph.find_shortest_chains(importer="slipstream.parallel", imported="slipstream.train", as_packages=True) == set()
    # The layouts meet only through the facade: neither imports the other.
    assert not graph.chain_exists(importer="slipstream.train.layout_dp", imported="slipstream.train.layout_mesh")
    assert not graph.chain_exists(importer="slipstream.train.layout_mesh", imported="slipstream.train.layout_dp")
