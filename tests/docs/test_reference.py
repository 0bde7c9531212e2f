"""docs/reference.md is what the generator makes from the code, and leaves no option out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.config import FLAT_NAMES
from slipstream.tools import reference

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "reference.md"


def test_the_page_is_what_the_code_generates():
    assert PAGE.read_text() == reference.render(), (
        "docs/reference.md is stale: run `python3 -m slipstream.tools.reference` and commit the page")


def test_every_trainconfig_field_has_a_row_with_its_default_and_a_description():
    text = PAGE.read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}
    missing = [name for name in FLAT_NAMES if name not in rows]
    assert missing == []
    for name in FLAT_NAMES:
        cells = [c.strip() for c in rows[name].split(" | ")]
        assert len(cells) >= 7 and cells[4].startswith("`") and cells[6].rstrip(" |"), rows[name]


def test_a_field_without_a_docstring_stops_the_generator(monkeypatch):
    docs = reference.field_docs()
    docs.pop(("NumericsConfig", "accumulate_steps"))
    monkeypatch.setattr(reference, "field_docs", lambda: docs)
    with pytest.raises(reference.ReferenceError, match="accumulate_steps"):
        reference.render()


def test_a_number_without_a_unit_stops_the_generator(monkeypatch):
    monkeypatch.delitem(reference.UNITS, "checkpoint_keep_last")
    with pytest.raises(reference.ReferenceError, match="checkpoint_keep_last .* has no unit"):
        reference.render()


def test_check_mode_reports_a_stale_page(tmp_path):
    stale = tmp_path / "reference.md"
    stale.write_text(PAGE.read_text().replace("micro-steps", "steps", 1))
    cmd = [sys.executable, "-m", "slipstream.tools.reference", "--check"]
    assert subprocess.run([*cmd, str(stale)], capture_output=True, text=True).returncode == 1
    assert subprocess.run([*cmd, str(PAGE)], capture_output=True, text=True).returncode == 0
