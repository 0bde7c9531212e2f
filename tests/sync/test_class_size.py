"""No class in sync/ over 400 lines (issue #44): a class that grew past one responsibility is split
into collaborators (HookSync's groups, codec plan, direct path and state; AutoPolicy's codec timing)."""

from __future__ import annotations

import ast
from pathlib import Path

from slipstream import sync

MAX_CLASS_LINES = 400
SYNC = Path(sync.__file__).resolve().parent


def test_no_class_in_sync_is_over_400_lines():
    over = []
    for path in sorted(SYNC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                over.append(f"{path.relative_to(SYNC)}: {node.name} is {node.end_lineno - node.lineno + 1} lines")
    assert not over, f"classes over {MAX_CLASS_LINES} lines (split them by responsibility):\n" + "\n".join(over)
