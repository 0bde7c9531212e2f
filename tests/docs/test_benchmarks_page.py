"""BENCHMARKS.md stays a headline page (issue #44 item 4): short, every claim with the command
that measured it, and the long tables in benchmarks/results/*.md files that it links."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "BENCHMARKS.md"
RESULTS = REPO / "benchmarks" / "results"
MAX_LINES = 400
HEADLINE = ["claim", "figure", "peer and ratio", "command", "date", "commit"]
# A command cell names what a reader types: a backticked span that starts with one of these.
LAUNCHERS = ("python ", "python3 ", "sudo ", "slipstream ", "bash ", "PYTHONPATH=")
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def headline_rows(text: str) -> list[list[str]]:
    """The body rows of every table whose header is HEADLINE."""
    rows, inside = [], False
    for line in text.splitlines():
        if not line.startswith("|"):
            inside = False
            continue
        cells = _cells(line)
        if cells == HEADLINE:
            inside = True
        elif inside and not set("".join(cells)) <= set("-: "):
            rows.append(cells)
    return rows


def _anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def test_the_page_is_at_most_400_lines():
    n = len(PAGE.read_text().splitlines())
    assert n <= MAX_LINES, f"BENCHMARKS.md has {n} lines (at most {MAX_LINES}): move tables to benchmarks/results/*.md"


def test_every_headline_row_has_its_command_date_and_commit():
    rows = headline_rows(PAGE.read_text())
    assert len(rows) >= 20, f"found {len(rows)} headline rows: is the table header still {' | '.join(HEADLINE)}?"
    bad = []
    for row in rows:
        if len(row) != len(HEADLINE):
            bad.append(f"{row[0]}: {len(row)} cells")
            continue
        cell = dict(zip(HEADLINE, row))
        commands = re.findall(r"`([^`]+)`", cell["command"])
        if not any(c.startswith(LAUNCHERS) for c in commands):
            bad.append(f"{cell['claim']}: no backticked command in {cell['command']!r}")
        if not cell["figure"] or not cell["date"] or not cell["commit"]:
            bad.append(f"{cell['claim']}: empty figure, date or commit ('not recorded' where unknown)")
    assert bad == []


def test_every_results_file_it_links_exists_and_every_detail_file_is_linked():
    linked = set()
    for target, _ in LINK.findall(PAGE.read_text()):
        if target.startswith("benchmarks/results/"):
            assert (REPO / target).is_file(), f"BENCHMARKS.md links {target}, which does not exist"
            linked.add(REPO / target)
    assert linked, "BENCHMARKS.md links no detail file under benchmarks/results/"
    # The moved detail pages (not the conformance matrix's own generated reports) are all reachable.
    detail = {p for p in RESULTS.glob("*.md") if p.read_text().startswith("Moved verbatim from BENCHMARKS.md")}
    assert detail - linked == set()


def test_links_into_the_benchmark_pages_resolve_with_their_anchors():
    pages = [REPO / "README.md", PAGE, *sorted((REPO / "docs").glob("*.md")), *sorted(RESULTS.glob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in LINK.findall(page.read_text()):
            path = (page.parent / target).resolve()
            if "://" in target or not (path == PAGE or path.parent == RESULTS):
                continue
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
            elif anchor:
                headings = re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)
                if anchor[1:] not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.relative_to(REPO)} -> {target}{anchor}")
    assert broken == []
