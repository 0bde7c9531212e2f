"""The fast tier: the test modules that fit five minutes on 2 cores, for every change (a pytest plugin).

``python3 -m pytest -q --tier fast`` runs only the modules listed in ``tests/fast_tier.txt``;
the full suite (no ``--tier``) stays the README's command and CI's. The list is chosen from a
measured run, not by hand: every full run writes a timeline of each test's seconds
(tests/records.py), and

    python3 -m tests.tiers update .test-records/latest/timeline.jsonl

rewrites the list. Modules, not single tests, are the unit: a module's fixtures (a 2-rank run
shared by its tests) cost the same whichever of its tests runs. The choice takes the cheapest
module of every test package first (so every package is covered), then the cheapest of the
rest while the measured total stays within the budget (180 s of test time by default; pytest's
start-up and collection take the rest of the five minutes).

Example::

    python3 -m pytest -q --tier fast        # the fast tier
    python3 -m tests.tiers update .test-records/latest/timeline.jsonl --budget-s 180
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
FAST_LIST = TESTS / "fast_tier.txt"
DEFAULT_BUDGET_S = 180.0
HEADER = ("# The fast tier (python3 -m pytest -q --tier fast): test modules chosen by tests/tiers.py\n"
          "# from a measured full run; regenerate with python3 -m tests.tiers update TIMELINE.\n")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=("fast",), default=None,
                     help="run only a tier of the suite: fast = the modules in tests/fast_tier.txt (about 5 min)")


def fast_modules(path: Path = FAST_LIST) -> list[str]:
    """The module paths of the fast tier (``tests/sync/test_codecs.py``), in the list's order."""
    return [line.split("#", 1)[0].strip() for line in path.read_text().splitlines()
            if line.split("#", 1)[0].strip()]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--tier") != "fast":
        return
    keep = set(fast_modules())
    chosen = [item for item in items if item.nodeid.split("::", 1)[0] in keep]
    config.hook.pytest_deselected(items=[item for item in items if item not in set(chosen)])
    items[:] = chosen


def package_of(module: str) -> str:
    """``tests/sync/test_x.py`` -> ``sync``; a module directly under tests/ -> ``tests``."""
    parts = module.split("/")
    return parts[1] if len(parts) > 2 else "tests"


def choose(module_seconds: dict[str, float], budget_s: float = DEFAULT_BUDGET_S) -> list[str]:
    """The modules of the fast tier: every package's cheapest module, then the cheapest others
    while the total stays within ``budget_s``. Sorted by path.

    Example::

        choose({"tests/a/test_x.py": 1.0, "tests/a/test_y.py": 90.0, "tests/b/test_z.py": 2.0}, 10.0)
        # ["tests/a/test_x.py", "tests/b/test_z.py"]
    """
    by_cost = sorted(module_seconds, key=lambda m: (module_seconds[m], m))
    chosen: list[str] = []
    covered: set[str] = set()
    for module in by_cost:  # the cheapest of each package, whatever it costs
        if package_of(module) not in covered:
            covered.add(package_of(module))
            chosen.append(module)
    total = sum(module_seconds[m] for m in chosen)
    for module in by_cost:
        if module not in chosen and total + module_seconds[module] <= budget_s:
            chosen.append(module)
            total += module_seconds[module]
    return sorted(chosen)


def module_seconds_from(timeline: Path) -> dict[str, float]:
    """Each module's measured seconds (setup, call and teardown of its tests) from a records timeline."""
    seconds: dict[str, float] = defaultdict(float)
    for line in timeline.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            seconds[row["test"].split("::", 1)[0]] += float(row["seconds"])
    return dict(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tests.tiers", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("update", help="rewrite tests/fast_tier.txt from a full run's timeline.jsonl")
    up.add_argument("timeline", type=Path)
    up.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    args = parser.parse_args(argv)
    if not args.timeline.is_file():
        parser.error(f"no timeline at {args.timeline} (a full run writes .test-records/latest/timeline.jsonl)")
    seconds = module_seconds_from(args.timeline)
    chosen = choose(seconds, args.budget_s)
    total = sum(seconds[m] for m in chosen)
    FAST_LIST.write_text(HEADER + f"# {len(chosen)} of {len(seconds)} modules, {total:.0f} s measured "
                         f"in {args.timeline.parent.name}\n" + "".join(f"{m}\n" for m in chosen))
    print(f"{FAST_LIST}: {len(chosen)} of {len(seconds)} modules, {total:.0f} s of {sum(seconds.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
