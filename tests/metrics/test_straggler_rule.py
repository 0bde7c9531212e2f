"""When a straggler is named: a large effect (relative and absolute) that lasts (issue #46 item 7).

Fixed figures only: the busy seconds per rank that the ranks' exchange would carry.
"""

from __future__ import annotations

import pytest

from slipstream.metrics.straggler import MIN_EXCESS_S, StragglerDetector

# Rank 0's busy_s_ranks (ms) of the README's script on 2 CPU ranks (600 steps, a log step every
# 10, on a shared 2-core machine): noise. The old rule named rank 0 at steps 110-130 and rank 1
# at 450-470; the run of the same script printed 7 "straggler:" lines.
README_BUSY_MS = [
    (1.541, 0.934), (0.546, 0.537), (0.666, 0.598), (0.566, 0.516), (0.553, 0.536), (0.684, 0.581),
    (0.702, 1.132), (0.706, 0.607), (0.724, 0.672), (1.652, 0.638), (1.602, 0.617), (0.703, 0.71),
    (0.749, 0.759), (0.506, 0.529), (0.469, 0.447), (0.572, 0.53), (0.51, 0.427), (0.544, 0.495),
    (0.961, 0.65), (0.491, 0.45), (0.637, 0.603), (0.649, 0.644), (0.509, 0.522), (0.496, 0.497),
    (0.539, 0.475), (0.429, 0.437), (0.582, 0.63), (0.513, 0.513), (0.456, 0.429), (0.425, 0.428),
    (0.885, 0.719), (0.763, 1.131), (0.607, 0.629), (0.643, 0.577), (0.673, 0.686), (0.959, 0.795),
    (0.746, 0.811), (0.725, 0.905), (0.438, 0.433), (0.519, 0.466), (0.585, 0.579), (0.489, 0.578),
    (0.263, 0.379), (0.319, 0.415), (0.535, 0.568), (0.563, 0.571), (0.507, 0.509), (0.409, 0.412),
    (0.537, 0.521), (0.583, 0.548), (0.505, 0.529), (0.475, 0.493), (0.587, 0.586), (0.45, 0.465),
]


def _verdicts(det: StragglerDetector, rows) -> list:
    return [det.observe(list(row)) for row in rows]


def test_the_readme_scripts_noise_names_no_straggler():
    verdicts = _verdicts(StragglerDetector(world_size=2), [(a / 1e3, b / 1e3) for a, b in README_BUSY_MS])
    assert all(v is None for v in verdicts), [v for v in verdicts if v is not None][0].message()


def test_a_large_relative_but_tiny_absolute_lead_is_noise():
    # The evidence: "0.9 ms vs 0.8 ms of compute", +12 %, every time, same rank.
    det = StragglerDetector(world_size=2)
    assert all(v is None for v in _verdicts(det, [(0.0008, 0.0009)] * 10))
    # Three times the compute, but 1.6 ms: still under the absolute minimum.
    assert all(v is None for v in _verdicts(StragglerDetector(world_size=2), [(0.0008, 0.0024)] * 10))
    assert MIN_EXCESS_S == pytest.approx(0.002)


def test_a_large_absolute_but_small_relative_lead_is_noise():
    det = StragglerDetector(world_size=2, threshold=0.1)
    assert all(v is None for v in _verdicts(det, [(1.00, 1.05)] * 10))  # 50 ms, but 5 %


def test_the_same_rank_must_lead_in_consecutive_exchanges():
    # Rank 1 leads by 30 ms in 2 of every 3 exchanges (the old rule, 3 of the last 5, named it).
    rows = [(0.10, 0.13), (0.10, 0.13), (0.10, 0.10)] * 4
    assert all(v is None for v in _verdicts(StragglerDetector(world_size=2), rows))
    # A lead that moves between ranks is not a straggler either.
    rows = [(0.13, 0.10), (0.10, 0.13)] * 5
    assert all(v is None for v in _verdicts(StragglerDetector(world_size=2), rows))


def test_a_lasting_lead_is_named_once_and_one_quiet_window_keeps_it():
    det = StragglerDetector(world_size=3)
    slow = [0.100, 0.140, 0.100]  # rank 1: 40 ms, 40 % over the median
    assert _verdicts(det, [slow, slow]) == [None, None]
    v = det.observe(slow)
    assert v is not None and v.rank == 1 and v.excess_s == pytest.approx(0.04) and v.slowdown == pytest.approx(0.4)
    assert "in 3 of the last 3 log steps" in v.message()
    assert det.observe([0.1, 0.1, 0.1]).rank == 1  # one quiet window: still named (not dropped, then re-announced)
    assert det.observe(slow).rank == 1
    # It recovers: after the slow exchanges are no longer most of the last 5, the verdict goes.
    rest = _verdicts(det, [[0.1, 0.1, 0.1]] * 3)
    assert rest[-1] is None


def test_persist_must_fit_the_window():
    with pytest.raises(ValueError, match="persist must be in 1..window"):
        StragglerDetector(world_size=2, persist=6, window=5)
