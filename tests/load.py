"""Run chosen tests again and again beside CPU-bound neighbours: each test's pass rate and time spread.

A test that passes alone and fails in the full suite usually fails from load: a window that
a slow start-up overruns, a timeout that contention stretches. This harness makes that load
on purpose. It starts N neighbours (Python processes spinning on one core each), then runs
pytest R times on the chosen tests, one fresh pytest process a round (no state shared between
rounds), each writing a JUnit XML report; then it prints, per test, passes of runs and the
min / median / max seconds, and the first failure's message. Exit code 0 only when every run
of every test passed.

    python3 -m tests.load --neighbours 2 --repeat 20 -- tests/job/test_run_local.py -k usage_error
    python3 -m tests.load -n 2 -r 3 --out /tmp/load -- tests/integration/test_heal_in_place.py

Everything after ``--`` goes to pytest as it is. Each round's records (tests/records.py: failed
tests' whole reports and their workers' logs) go to OUT/round-NN/records.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPIN = "while True:\n    pass\n"


@dataclass
class TestRuns:
    """One test's outcomes over the rounds."""

    seconds: list[float] = field(default_factory=list)
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    first_failure: str = ""

    def line(self, name: str) -> str:
        runs = self.passed + self.failed
        spread = (f"{min(self.seconds):.2f} / {statistics.median(self.seconds):.2f} / {max(self.seconds):.2f} s"
                  if self.seconds else "-")
        skipped = f", {self.skipped} skipped" if self.skipped else ""
        return f"{self.passed}/{runs} passed{skipped}  {spread}  {name}"


def start_neighbours(count: int) -> list[subprocess.Popen]:
    """``count`` CPU-bound processes, each in its own session so one signal ends it whole."""
    return [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(count)]


def stop_neighbours(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def read_junit(path: Path, into: dict[str, TestRuns]) -> None:
    """Adds each test case of one round's JUnit report to ``into``."""
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        runs = into.setdefault(name, TestRuns())
        runs.seconds.append(float(case.get("time", 0.0)))
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            runs.failed += 1
            runs.first_failure = runs.first_failure or (bad.get("message") or "")[:300]
        elif case.find("skipped") is not None:
            runs.skipped += 1
        else:
            runs.passed += 1


def run_rounds(pytest_args: list[str], repeat: int, out: Path, neighbours: int) -> dict[str, TestRuns]:
    results: dict[str, TestRuns] = {}
    procs = start_neighbours(neighbours)
    try:
        for r in range(repeat):
            rnd = out / f"round-{r:02d}"
            rnd.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "SLIPSTREAM_TEST_RECORDS": str(rnd / "records")}
            t0 = time.monotonic()
            code = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   f"--junitxml={rnd / 'junit.xml'}", *pytest_args],
                                  cwd=REPO, env=env, stdout=open(rnd / "pytest.out", "w"),
                                  stderr=subprocess.STDOUT).returncode
            load = os.getloadavg()[0]
            print(f"round {r + 1}/{repeat}: pytest exit {code} in {time.monotonic() - t0:.1f} s, load {load:.1f}",
                  flush=True)
            if (rnd / "junit.xml").exists():
                read_junit(rnd / "junit.xml", results)
    finally:
        stop_neighbours(procs)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m tests.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--neighbours", type=int, default=2, help="CPU-bound neighbour processes (default 2)")
    parser.add_argument("-r", "--repeat", type=int, default=20, help="pytest rounds (default 20)")
    parser.add_argument("--out", type=Path, default=None, help="where each round's reports go (default: a temp dir)")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="-- then pytest's arguments")
    args = parser.parse_args(argv)
    rest = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    if not rest:
        parser.error("name the tests after --, e.g. -- tests/job/test_run_local.py")
    if args.repeat < 1 or args.neighbours < 0:
        parser.error(f"--repeat must be at least 1 and --neighbours at least 0 (got {args.repeat}, {args.neighbours})")
    out = args.out or Path(tempfile.mkdtemp(prefix="slipstream-load-"))
    print(f"{args.repeat} rounds beside {args.neighbours} CPU-bound neighbour(s) on {os.cpu_count()} cores; "
          f"reports in {out}", flush=True)
    results = run_rounds(rest, args.repeat, out, args.neighbours)
    if not results:
        print("no test ran (see round-00/pytest.out)")
        return 1
    print("\npasses/runs  min / median / max  test")
    for name, runs in sorted(results.items()):
        print(runs.line(name))
        if runs.first_failure:
            print(f"    first failure: {runs.first_failure}")
    return 0 if all(r.failed == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
