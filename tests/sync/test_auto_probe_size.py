"""``auto``'s start-up probe is scaled to the model (issue #35: ``auto`` never loses on a short job).

A small model's probe sends about its own gradient, not 4 MiB: at 200 Mbit/s the fixed
probe cost a 0.09M-parameter model 0.72-0.82 s (5-6 % of a 15 s job), the scaled one
about 0.1 s. A large model still probes at the full size. The collectives are replaced
by a recorder (one process, no timing): what is checked is what the probe would send.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from slipstream.network.link import Link, allreduce_bytes
from slipstream.sync.auto import PROBE_MAX_BYTES, PROBE_MIN_BYTES, PROBE_SMALL_BYTES, flat_prober, probe_sizes

SMALL_MODEL_BYTES = 85_002 * 4  # examples/ddp_torchrun.py --width 256 --depth 2: 0.09M parameters
LARGE_MODEL_BYTES = 3_224_586 * 4  # --width 1024 --depth 4: 3.2M parameters


class _Agreeing:
    """A control wire of one rank: agreeing changes nothing."""

    size = 1

    def agree(self, values, op=None):
        return list(values)


@pytest.fixture
def sent(monkeypatch):
    """The payload bytes of every all-reduce the probe makes, on a pretend group of 2 ranks."""
    sizes: list[int] = []

    def all_reduce(t, *a, **k):
        sizes.append(t.numel() * t.element_size())

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return sizes


def test_probe_sizes_follow_the_gradient_between_the_bounds():
    assert probe_sizes(SMALL_MODEL_BYTES) == (PROBE_SMALL_BYTES, SMALL_MODEL_BYTES)
    assert probe_sizes(LARGE_MODEL_BYTES) == (PROBE_SMALL_BYTES, PROBE_MAX_BYTES)
    assert probe_sizes(1_000) == (PROBE_SMALL_BYTES, PROBE_MIN_BYTES)  # two sizes well apart, still
    assert PROBE_SMALL_BYTES < PROBE_MIN_BYTES < PROBE_MAX_BYTES == 4 << 20


def test_a_small_model_probes_with_its_own_gradient_not_4_mib(sent):
    link = flat_prober(None, _Agreeing(), "cpu", SMALL_MODEL_BYTES)()
    assert isinstance(link, Link) and link.ranks == 2
    assert max(sent) == SMALL_MODEL_BYTES and set(sent) == {PROBE_SMALL_BYTES, SMALL_MODEL_BYTES}, sent
    # At 200 Mbit/s: under 0.15 s of wire in all (a warm-up and three timed runs per size);
    # the fixed probe's 4 MiB alone took 0.67 s.
    wire_s = sum(allreduce_bytes(s, 2) for s in sent) / 25e6
    assert wire_s < 0.15, wire_s


def test_a_large_model_still_probes_fully(sent):
    flat_prober(None, _Agreeing(), torch.device("cpu"), LARGE_MODEL_BYTES)()
    assert sorted(set(sent)) == [PROBE_SMALL_BYTES, PROBE_MAX_BYTES], sent
    assert sent.count(PROBE_MAX_BYTES) == sent.count(PROBE_SMALL_BYTES) == 4, sent  # warm-up + 3 timed


def test_both_levels_probe_at_the_models_size_too(sent):
    """Two levels (several nodes of several ranks): the flat group and both levels are probed
    at the model's size, not 4 MiB each (the flat probe alone was scaled before)."""
    from types import SimpleNamespace

    from slipstream.sync.probe import probe_both

    g = SimpleNamespace(flat=None, intra=None, inter=None, control=None,
                        topology=SimpleNamespace(local_world_size=2, num_nodes=2))
    links = probe_both(g, "cpu", probe_sizes(SMALL_MODEL_BYTES))
    assert set(sent) == {PROBE_SMALL_BYTES, SMALL_MODEL_BYTES}, sent
    assert len(sent) == 3 * 2 * 4, sent  # flat, intra, inter: two sizes, a warm-up and three timed runs each
    assert links.flat.ranks == 2
