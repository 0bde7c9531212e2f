"""The fast tier (tests/tiers.py): chosen from a measured run, every package covered."""

from __future__ import annotations

import json
from pathlib import Path

from tests import tiers

TESTS = Path(__file__).resolve().parent


def test_every_package_is_covered_then_the_cheapest_fill_the_budget():
    seconds = {"tests/sync/test_a.py": 30.0, "tests/sync/test_b.py": 2.0, "tests/sync/test_c.py": 5.0,
               "tests/slurm/test_s.py": 50.0, "tests/test_top.py": 1.0, "tests/data/test_d.py": 4.0}
    # The cheapest of each package (sync 2, slurm 50: over the budget alone, still covered, top 1,
    # data 4), then sync's 5 s fits (62) and its 30 s does not.
    assert tiers.choose(seconds, budget_s=64.0) == [
        "tests/data/test_d.py", "tests/slurm/test_s.py", "tests/sync/test_b.py", "tests/sync/test_c.py",
        "tests/test_top.py"]


def test_update_reads_a_records_timeline(tmp_path, monkeypatch):
    timeline = tmp_path / "20261207-010000-1" / "timeline.jsonl"
    timeline.parent.mkdir()
    rows = [("tests/a/test_x.py::test_1", 1.0), ("tests/a/test_x.py::test_2", 2.0), ("tests/a/test_y.py::t", 9.0),
            ("tests/b/test_z.py::t", 20.0)]
    timeline.write_text("".join(json.dumps({"test": t, "seconds": s, "outcome": "passed"}) + "\n" for t, s in rows))
    out = tmp_path / "fast_tier.txt"
    monkeypatch.setattr(tiers, "FAST_LIST", out)
    assert tiers.main(["update", str(timeline), "--budget-s", "25"]) == 0
    assert tiers.fast_modules(out) == ["tests/a/test_x.py", "tests/b/test_z.py"]  # 3 + 20; test_y's 9 would pass 25


def test_the_committed_list_names_modules_that_exist_and_covers_every_package():
    listed = tiers.fast_modules()
    missing = [m for m in listed if not (TESTS.parent / m).is_file()]
    assert missing == [], f"tests/fast_tier.txt names modules that are gone: {missing} (python3 -m tests.tiers update)"
    packages = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))} | {"tests"}
    uncovered = packages - {tiers.package_of(m) for m in listed}
    assert uncovered == set(), f"no module of {sorted(uncovered)} in the fast tier (python3 -m tests.tiers update)"
