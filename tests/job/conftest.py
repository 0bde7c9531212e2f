"""Helpers for the job-spec tests: run the CLI in-process and capture what it prints."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import yaml

from slipstream.cli import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "jobs"
GOLDEN = Path(__file__).resolve().parent / "golden"


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``slipstream ARGV`` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse errors
        code = exc.code if isinstance(exc.code, int) else 2
    out, err = capsys.readouterr()
    return code, out, err


def write_spec(data, directory: str | None = None) -> str:
    """Write ``data`` (a mapping, or raw text) to a fresh .yaml file; returns its path."""
    fd, path = tempfile.mkstemp(suffix=".yaml", dir=directory)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def base_spec() -> dict:
    return {"name": "t", "image": "img:1", "command": ["python", "train.py"]}
