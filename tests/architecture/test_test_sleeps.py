"""No test waits on the clock where it could wait on an event (issue #47).

A fixed sleep in a test is a bet that something finishes within it; under the full suite's
load (2 cores, CPU-bound neighbours, processes other tests left running) the bet is lost and
the test fails while the product is right. So every ``sleep`` call in tests/ is checked:

- outside a loop, at most ``MAX_BARE_S`` (a yield to another thread, a nudge between polls);
- inside a ``while``/``for`` loop it is a poll interval: at most ``MAX_POLL_S``, the loop
  waiting for the event with a deadline;
- anything longer, or an argument that is not a number (a workload's stand-in compute, a
  worker made to hang), is named in ``ALLOWED`` with the reason it is not a wait.

Keyed by file and enclosing function, so moving lines does not break the list.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
MAX_BARE_S = 0.1
MAX_POLL_S = 0.5

# (file relative to tests/, enclosing function or "<module>") -> why this sleep is not a wait on an event.
ALLOWED: dict[tuple[str, str], str] = {
    ("metrics/metrics_workers.py", "<lambda>"): "stand-in compute: one rank made slow on purpose (straggler detection)",
    ("integration/scripts_ft_train.py", "<module>"): "a worker made to hang (the hang detector's subject) and stand-in step compute",
    ("integration/scripts_zero_change.py", "<module>"): "a script made to hang inside its loop (the hang report's subject)",
    ("cluster/scripts_probe.py", "<module>"): "a worker that stays alive until the test kills it",
    ("conformance/test_harness_dead_rank.py", "die_on_rank_1"): "a rank that hangs until the harness kills it",
    ("data/test_sampler.py", "__getitem__"): "stand-in read latency of a slow storage, the prefetch's subject",
    ("data/test_sampler.py", "run"): "stand-in compute per step, so the prefetch has something to overlap",
    ("checkpoint/test_save_agreement.py", "_loop"): "stand-in compute per step between save agreements",
    ("checkpoint/test_cadence.py", "synchronize"): "stand-in for the step's kernels a device copy waits for: the time the stall must leave out",
    ("checkpoint/test_async_commit.py", "slow_prune"): "a slow file system: the writer thread must still be busy when the next save comes",
    ("launch/test_agent_exit.py", "other_node"): "a node that leaves 0.3 s late on purpose: the host's wait for it is the subject",
    ("data/test_cache.py", "test_fetch_ahead_downloads_the_coming_shards"): (
        "checks an absence (no shard fetched ahead with fetch_ahead=0): no event marks it; load can only "
        "make it pass wrongly, never fail"),
}


def _number(node: ast.AST) -> float | None:
    return float(node.value) if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) else None


class _Sleeps(ast.NodeVisitor):
    """Every sleep call: (line, enclosing function, inside a loop, seconds or None)."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str, bool, float | None]] = []
        self.functions: list[str] = ["<module>"]
        self.loops = 0

    def _function(self, node: ast.AST, name: str) -> None:
        self.functions.append(name)
        loops, self.loops = self.loops, 0  # a function defined in a loop is not itself a poll
        self.generic_visit(node)
        self.loops = loops
        self.functions.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._function(node, node.name)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._function(node, "<lambda>")

    def _loop(self, node: ast.AST) -> None:
        self.loops += 1
        self.generic_visit(node)
        self.loops -= 1

    visit_While = visit_For = _loop  # type: ignore[assignment]

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name == "sleep" and node.args:
            self.found.append((node.lineno, self.functions[-1], self.loops > 0, _number(node.args[0])))
        self.generic_visit(node)


def offenders(root: Path, allowed: dict[tuple[str, str], str]) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        visitor = _Sleeps()
        visitor.visit(ast.parse(path.read_text(), filename=str(path)))
        for line, function, in_loop, seconds in visitor.found:
            limit = MAX_POLL_S if in_loop else MAX_BARE_S
            if seconds is not None and seconds <= limit:
                continue
            if (rel, function) in allowed:
                continue
            what = "a poll interval" if in_loop else "a fixed wait"
            bad.append(f"tests/{rel}:{line} ({function}): sleep({seconds if seconds is not None else '...'}) "
                       f"is {what} over {limit} s")
    return bad


def test_no_test_waits_on_the_clock_where_it_could_wait_on_an_event():
    found = offenders(TESTS, ALLOWED)
    assert found == [], ("wait on the event (a pipe, a file, a process's exit, a poll with a deadline), or name "
                         "the sleep in ALLOWED with the reason it is not a wait:\n" + "\n".join(found))


def test_every_allowed_sleep_still_exists():
    present = set()
    for path in sorted(TESTS.rglob("*.py")):
        visitor = _Sleeps()
        visitor.visit(ast.parse(path.read_text()))
        present |= {(path.relative_to(TESTS).as_posix(), fn) for _, fn, _, _ in visitor.found}
    assert set(ALLOWED) - present == set(), "stale entries in ALLOWED"


def test_the_check_finds_a_fixed_wait_and_passes_a_poll(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import time\n"
        "def test_waits():\n    start()\n    time.sleep(0.5)\n    check()\n"
        "def test_polls():\n    while not done():\n        time.sleep(0.2)\n"
        "def test_nudges():\n    time.sleep(0.05)\n")
    assert offenders(tmp_path, {}) == ["tests/test_x.py:4 (test_waits): sleep(0.5) is a fixed wait over 0.1 s"]
    assert offenders(tmp_path, {("test_x.py", "test_waits"): "a reason"}) == []
