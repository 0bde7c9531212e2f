"""What a test run leaves behind for whoever reads its failure (a pytest plugin).

A failed CI used to say little more than the assertion: the workers' logs lived in
the failed test's ``tmp_path`` and were gone with the machine. Every run of the suite
now writes a records directory:

- ``failures/NN-<test>.txt``: each failed test's whole report (every phase that failed),
  its captured output and log, and the last lines of every log file its processes
  wrote under its ``tmp_path`` (``*.log``, ``*.err``, ``*.out``, ``*.jsonl``, ...);
- ``timeline.jsonl``: one line per test: outcome, seconds, the 1-minute load average at
  its start and end, how many processes of the run were alive after it;
- ``leftovers.txt``: the processes a test started and left running after its teardown
  (found by a marker in their environment, so children re-parented to init count too);
  a process a module- or session-scoped fixture holds shows here until the fixture stops it;
- ``still-running.txt``: the processes still alive once every fixture is torn down: leaks.

The directory is ``$SLIPSTREAM_TEST_RECORDS`` when set, else
``<rootdir>/.test-records/<UTC time>-<pid>`` (a ``latest`` link points at the newest).
The terminal summary names it; ``python3 -m tests.records show [DIR]`` prints the first
failure's assertion and its workers' last log lines (``.ci/run`` does, so a failed CI
says why in its last screen).

Example::

    SLIPSTREAM_TEST_RECORDS=/tmp/rec python3 -m pytest -q tests/job
    python3 -m tests.records show /tmp/rec
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

RECORDS_ENV = "SLIPSTREAM_TEST_RECORDS"
# Every process the suite starts inherits this marker, so a leftover is found even when it
# was re-parented to init (an orphaned rank, a spare whose supervisor died).
MARKER_ENV = "SLIPSTREAM_TEST_SESSION"
LOG_SUFFIXES = (".log", ".err", ".out", ".txt", ".jsonl", ".stderr", ".stdout")
LOG_TAIL_LINES = 40
LOG_FILES_PER_FAILURE = 12
LOG_BYTES_READ = 64 * 1024  # the tail of a large log is what explains its end
OWN_HELPERS = re.compile(r"multiprocessing\.(resource_tracker|forkserver)")


@dataclass
class _Session:
    root: Path
    marker: str
    failures: int = 0
    leftover_tests: int = 0
    before: set[int] = field(default_factory=set)
    started_at: float = 0.0
    load_at_start: float = 0.0
    tmp_paths: dict[str, Path] = field(default_factory=dict)


_SESSION_KEY = pytest.StashKey[_Session]()


def _records_dir(config: pytest.Config) -> Path:
    chosen = os.environ.get(RECORDS_ENV)
    if chosen:
        return Path(chosen)
    base = Path(config.rootpath) / ".test-records"
    return base / f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{os.getpid()}"


def pytest_configure(config: pytest.Config) -> None:
    root = _records_dir(config)
    (root / "failures").mkdir(parents=True, exist_ok=True)
    marker = f"{os.getpid()}-{time.time_ns()}"
    os.environ[MARKER_ENV] = marker
    if not os.environ.get(RECORDS_ENV):
        latest = root.parent / "latest"
        try:
            if latest.is_symlink() or latest.exists():
                latest.unlink()
            latest.symlink_to(root.name)
        except OSError:
            pass  # a read-only or foreign parent: the path is printed anyway
    config.stash[_SESSION_KEY] = _Session(root=root, marker=marker)


def _marked_processes(marker: str) -> dict[int, str]:
    """pid -> command line of every live process (not this one) that carries ``marker``."""
    found: dict[int, str] = {}
    me = os.getpid()
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else []:
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                if f"{MARKER_ENV}={marker}".encode() not in f.read():
                    continue
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] == b"Z":
                    continue  # a zombie holds no CPU: its parent has not reaped it yet
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                found[int(entry.name)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):  # noqa: ANN001, ANN201 - pytest's hook
    state = item.config.stash.get(_SESSION_KEY, None)
    if state is not None:
        state.before = set(_marked_processes(state.marker))
        state.started_at = time.monotonic()
        state.load_at_start = os.getloadavg()[0]
    yield
    if state is None:
        return
    # The harness's forkserver and multiprocessing's resource tracker live for the session: the
    # first test that starts them did not leak them.
    left = {pid: cmd for pid, cmd in _marked_processes(state.marker).items()
            if pid not in state.before and not OWN_HELPERS.search(cmd)}
    if left:
        state.leftover_tests += 1
        with open(state.root / "leftovers.txt", "a") as f:
            f.write(f"{item.nodeid}\n")
            for pid, cmd in sorted(left.items()):
                f.write(f"    {pid} {cmd[:300]}\n")
    line = {"test": item.nodeid, "outcome": getattr(item, "_records_outcome", "passed"),
            "seconds": round(time.monotonic() - state.started_at, 3),
            "load_start": round(state.load_at_start, 2), "load_end": round(os.getloadavg()[0], 2),
            "leftover_processes": len(left)}
    with open(state.root / "timeline.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    state.tmp_paths.pop(item.nodeid, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):  # noqa: ANN001, ANN201 - pytest's hook
    outcome = yield
    report = outcome.get_result()
    state = item.config.stash.get(_SESSION_KEY, None)
    if state is None:
        return
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if isinstance(tmp, Path):
        state.tmp_paths[item.nodeid] = tmp
    if report.failed:
        item._records_outcome = "failed"  # type: ignore[attr-defined]
        _write_failure(state, item, report)
    elif report.skipped and report.when == "call":
        item._records_outcome = "skipped"  # type: ignore[attr-defined]


def _safe_name(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[:150]


def _tail(path: Path) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - LOG_BYTES_READ))
            text = f.read().decode(errors="replace")
    except OSError as exc:
        return [f"(unreadable: {exc})"]
    return text.splitlines()[-LOG_TAIL_LINES:]


def _log_files(tmp: Path | None) -> list[Path]:
    if tmp is None or not tmp.is_dir():
        return []
    files = [p for p in tmp.rglob("*") if p.is_file() and p.suffix in LOG_SUFFIXES and p.stat().st_size > 0]
    files.sort(key=lambda p: p.stat().st_mtime, reverse=True)  # the newest logs speak last
    return files[:LOG_FILES_PER_FAILURE]


def _write_failure(state: _Session, item: pytest.Item, report: pytest.TestReport) -> None:
    state.failures += 1
    path = state.root / "failures" / f"{state.failures:02d}-{_safe_name(item.nodeid)}.txt"
    crash = getattr(report.longrepr, "reprcrash", None)
    with open(path, "w") as f:
        f.write(f"test: {item.nodeid}\nphase: {report.when}\nseconds: {report.duration:.2f}\n")
        f.write(f"load average at failure: {os.getloadavg()[0]:.2f}\n")
        if crash is not None:
            f.write(f"assertion: {crash.path}:{crash.lineno}: {crash.message}\n")
        f.write("\n== report ==\n")
        f.write(str(report.longrepr) + "\n")
        for name, content in report.sections:
            f.write(f"\n== {name} ==\n{content}\n")
        for log in _log_files(state.tmp_paths.get(item.nodeid)):
            f.write(f"\n== log {log} (last {LOG_TAIL_LINES} lines) ==\n")
            f.write("\n".join(_tail(log)) + "\n")


def still_running(marker: str, grace_s: float = 3.0) -> dict[int, str]:
    """The marked processes alive once every fixture is torn down, after ``grace_s`` for those
    already on their way out: the suite's real leaks. (A process a test leaves to a module- or
    session-scoped fixture is in leftovers.txt too, until that fixture stops it.)"""
    def leaks() -> dict[int, str]:
        # multiprocessing's helpers belong to pytest's own process and end with it.
        return {pid: cmd for pid, cmd in _marked_processes(marker).items() if not OWN_HELPERS.search(cmd)}

    deadline = time.monotonic() + grace_s
    alive = leaks()
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = leaks()
    return alive


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ANN001, ANN201 - pytest's hook
    state = config.stash.get(_SESSION_KEY, None)
    if state is None:
        return
    leftovers = f"; {state.leftover_tests} test(s) left processes running (leftovers.txt)" if state.leftover_tests else ""
    leaked = still_running(state.marker) if state.leftover_tests else {}
    if leaked:
        with open(state.root / "still-running.txt", "w") as f:
            f.writelines(f"{pid} {cmd[:300]}\n" for pid, cmd in sorted(leaked.items()))
        leftovers += f"; {len(leaked)} still running at the end (still-running.txt)"
    terminalreporter.write_line(f"test records: {state.root} ({state.failures} failure file(s){leftovers})")


def first_failure(root: Path) -> str:
    """The first failure's test, assertion and its workers' last log lines, as text for a
    console's last screen; an empty string when the run had none."""
    files = sorted((root / "failures").glob("*.txt"))
    if not files:
        return ""
    text = files[0].read_text(errors="replace")
    head = [line for line in text.splitlines()[:6] if line.startswith(("test:", "phase:", "assertion:", "load"))]
    logs = text.split("\n== log ", 1)
    shown = ["first failure (of %d): %s" % (len(files), files[0]), *head]
    if len(logs) == 2:
        shown += ["", "== log " + "\n".join(logs[1].splitlines()[:LOG_TAIL_LINES + 1])]
    else:
        report = text.split("\n== report ==\n", 1)[-1].split("\n== ", 1)[0]
        shown += ["", *report.splitlines()[-30:]]
    return "\n".join(shown)


def main(argv: list[str]) -> int:
    if len(argv) < 1 or argv[0] != "show":
        print("usage: python3 -m tests.records show [DIR]", file=sys.stderr)
        return 2
    root = Path(argv[1]) if len(argv) > 1 else Path(os.environ.get(RECORDS_ENV) or ".test-records/latest")
    if not (root / "failures").is_dir():
        print(f"tests.records: no records at {root}", file=sys.stderr)
        return 2
    text = first_failure(root)
    print(text or f"tests.records: no failure recorded in {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
