"""Slipstream never changes process-wide state the user's own code reads (the project's GPU rules, docs/gpu.md).

Checked on the source tree: no call that resets the CUDA allocator's statistics may appear
anywhere in src/. The recorder once reset the peak counters at each log step, and a user's
``torch.cuda.max_memory_allocated()`` after training read 2.6 GiB instead of 13.6 GiB
(H200, issue #42). The metrics read the counters through ``metrics/memory.py`` only.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "slipstream"
# torch.cuda's resets of its memory statistics (reset_max_memory_cached is the old alias).
RESETS = re.compile(r"\b(reset_peak_memory_stats|reset_max_memory_allocated|reset_max_memory_cached|"
                    r"reset_accumulated_memory_stats)\b")


def offenders(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if RESETS.search(line):
                found.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    return found


def test_no_source_file_resets_cuda_memory_statistics():
    found = offenders(SRC)
    assert found == [], ("these reset the user's CUDA memory counters (read them through "
                         "metrics/memory.py, never reset them):\n" + "\n".join(found))


def test_the_check_finds_a_reset(tmp_path):
    pkg = tmp_path / "slipstream"
    pkg.mkdir()
    (pkg / "ok.py").write_text("peak = torch.cuda.max_memory_allocated(device)\n")
    (pkg / "bad.py").write_text("x = 1\ntorch.cuda.reset_peak_memory_stats(device)\n")
    assert offenders(pkg) == ["slipstream/bad.py:2: torch.cuda.reset_peak_memory_stats(device)"]
