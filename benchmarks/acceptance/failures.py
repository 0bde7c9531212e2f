"""What the report shows for a failed step: the failing process's own stack, and the command
that reruns just that step. No torch (see benchmarks/acceptance/plan.py).

A stack is either a Python traceback (an exception: its last lines hold the innermost frames
and the error) or the block Python's faulthandler prints when native code crashes ("Fatal
Python error: Segmentation fault", then each thread's frames, *most recent call first*). The
second is what a segfault in torch or gloo leaves, and the only Python-level evidence of it:
the first GPU run's FSDP steps died of SIGSEGV with the report showing just "never finished".

Example::

    found = find_stack(Path("rank1/stderr.log").read_text())
    found.kind, found.summary   # ("native crash", "Fatal Python error: Segmentation fault (at layout_mesh.py:271 in ...)")
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

STACK_LINES = 25
"""Lines of a stack the report keeps: the innermost frames and the error of a traceback, or
faulthandler's header and the crashing thread's innermost frames. The GPU run's FSDP crash
had 32 frames, of which the first 20 (most recent first) named every layer from the gloo
call up to the kit's own train_one."""

TRACEBACK_HEAD = "Traceback (most recent call last):"
FATAL_HEAD = re.compile(r"^Fatal Python error: ")
# Lines that belong to a faulthandler block besides frames (indented) and blank lines.
FAULTHANDLER_LINE = re.compile(r"^(Current thread |Thread 0x|Stack \(most recent call first\)|Extension modules: |"
                               r"Python runtime state: |Garbage-collecting|<)")
THREAD_HEAD = re.compile(r"^(Current thread |Thread 0x|Stack \(most recent call first\))")
# Python: `  File "x.py", line 3, in f`; faulthandler: `  File "x.py", line 3 in f`.
FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+),? in (\S+)')
# A line that starts another record after an exception's message: a new stack, a glog-style
# torch log line (W1204 17:38:00...), a launcher line, a torch elastic prefix.
NEW_RECORD = re.compile(r"^(Traceback \(|Fatal Python error|[IWEF]\d{4} \d\d:|slipstream run:|\[default\d+\]:)")
# `slipstream run` / torchrun --tee prefixes every line of a worker with its local rank.
TEE_PREFIX = re.compile(r"^\[default(\d+)\]:", re.M)


@dataclass
class Stack:
    """One excerpt of a failing process's stack, and where it came from."""

    kind: str  # "traceback" (a Python exception) or "native crash" (faulthandler)
    text: str  # at most STACK_LINES lines
    summary: str  # one line: the error and its innermost frame
    source: str = ""  # where it was read (a rank's log, a result file)


def find_stack(text: str, lines: int = STACK_LINES) -> Stack | None:
    """The last stack in ``text`` (a traceback or a faulthandler block, whichever comes
    last), cut to ``lines`` lines; None when there is none.

    Example::

        find_stack("...\\nTraceback (most recent call last):\\n  File ...\\nValueError: x\\n").summary
    """
    rows = text.splitlines()
    tb = max((i for i, r in enumerate(rows) if r.startswith(TRACEBACK_HEAD)), default=-1)
    fatal = max((i for i, r in enumerate(rows) if FATAL_HEAD.match(r)), default=-1)
    if tb < 0 and fatal < 0:
        return None
    if fatal > tb:
        return _native(rows, fatal, lines)
    return _traceback(rows, tb, lines)


def _traceback(rows: list[str], start: int, lines: int) -> Stack:
    block = [rows[start]]
    i = start + 1
    while i < len(rows) and rows[i][:1] in (" ", "\t"):  # frames, source lines, carets
        block.append(rows[i])
        i += 1
    message = 0
    # The exception and its message, which may run over several lines (torch's often do).
    while i < len(rows) and rows[i].strip() and message < 20 and not NEW_RECORD.match(rows[i]):
        block.append(rows[i])
        i += 1
        message += 1
    frames = [m for r in block if (m := FRAME.match(r))]
    error = block[len(block) - message] if message else "(no exception line)"
    where = f" ({_where(frames[::-1])})" if frames else ""
    return Stack("traceback", "\n".join(block[-lines:]), f"{error.strip()[:240]}{where}")


def _native(rows: list[str], start: int, lines: int) -> Stack:
    """faulthandler's block: the header, then one section per thread; the crashing thread is
    "Current thread" when Python knows it; a crash in a thread Python did not start (gloo's,
    NCCL's) prints every thread as "Thread 0x..." and the one with frames is the one to read."""
    block = [rows[start]]
    i = start + 1
    while i < len(rows) and (not rows[i].strip() or rows[i][:1] in (" ", "\t") or FAULTHANDLER_LINE.match(rows[i])):
        block.append(rows[i])
        i += 1
    head: list[str] = []
    sections: list[list[str]] = []
    for row in block:
        if THREAD_HEAD.match(row):
            sections.append([row])
        elif row.startswith("Extension modules: ") or not row.strip():
            continue
        elif sections:
            sections[-1].append(row)
        else:
            head.append(row)
    current = [s for s in sections if s[0].startswith("Current thread ")]
    with_frames = [s for s in sections if any(FRAME.match(r) for r in s[1:])]
    chosen = (current or with_frames or sections or [[]])[0]
    others = len(with_frames) - (1 if chosen in with_frames else 0)
    note = [f"({others} other thread(s) with Python frames, not shown)"] if others else []
    room = max(1, lines - len(head) - len(note))
    text = "\n".join(head + chosen[:room] + note)
    frames = [m for r in chosen if (m := FRAME.match(r))]
    where = f" ({_where(frames)})" if frames else " (no Python frame)"
    return Stack("native crash", text, f"{rows[start].strip()[:200]}{where}")


def _frame_text(match: re.Match) -> str:
    path, line, func = match.groups()
    return f"{Path(path).name}:{line} in {func}"


# Frames of installed libraries and the interpreter: the innermost frame is often one of
# these (torch's dispatcher), while the line worth reading first is the innermost of ours.
LIBRARY_FRAME = re.compile(r"site-packages|dist-packages|^<frozen|/lib/python\d")


def _where(innermost_first: list[re.Match]) -> str:
    """The innermost frame, and the innermost one outside libraries when that is another."""
    text = f"at {_frame_text(innermost_first[0])}"
    ours = next((m for m in innermost_first if not LIBRARY_FRAME.search(m.group(1))), None)
    if ours is not None and ours is not innermost_first[0]:
        text += f"; innermost project frame {_frame_text(ours)}"
    return text


def rank_lines(text: str, local_rank: int) -> str:
    """One worker's lines out of a launch's tee'd output (``[default<r>]:`` prefixes), unprefixed."""
    prefix = f"[default{local_rank}]:"
    return "\n".join(line[len(prefix):] for line in text.splitlines() if line.startswith(prefix))


def rank_log_files(log_dir: Path, rank: int) -> list[Path]:
    """A worker's own stderr and stdout under ``slipstream run --log-dir DIR`` (torch's elastic
    agent: DIR/<run id>/attempt_<k>/<local rank>/{stderr,stdout}.log), newest attempt first.
    One node, so the local rank is the rank."""
    def attempt(path: Path) -> int:
        return int(path.parent.parent.name.rsplit("_", 1)[-1])

    found = log_dir.glob(f"*/attempt_*/{rank}/std*.log")
    return sorted(found, key=lambda path: (-attempt(path), path.name != "stderr.log"))


def first_failed_rank(launch_text: str) -> int | None:
    """The rank `slipstream run` names as the first to fail ("first failure: rank 1 ..."), if any."""
    found = re.search(r"first failure: rank (\d+)", launch_text)
    return int(found.group(1)) if found else None


def rerun_command(name: str, out: Path, device: str, steps_scale: float = 1.0, no_fork: bool = False) -> str:
    """The command that reruns just step ``name`` (and the environment step, which always runs),
    from the root of the checkout, into a folder of its own beside the full run's report (whose
    acceptance.md it would otherwise replace).

    Example::

        rerun_command("layout/fsdp", Path("/tmp/acc"), "cuda")
        # PYTHONPATH=src python3 -m benchmarks.gpu_acceptance --out /tmp/acc/rerun-layout__fsdp --device cuda --only '^layout/fsdp$'
    """
    words = ["PYTHONPATH=src", "python3", "-m", "benchmarks.gpu_acceptance",
             "--out", str(out / f"rerun-{name.replace('/', '__')}"), "--device", device, "--only", only_regex(name)]
    if steps_scale != 1.0:
        words += ["--steps-scale", f"{steps_scale:g}"]
    if no_fork:
        words.append("--no-fork")
    return " ".join(w if w.startswith("PYTHONPATH=") else shlex.quote(w) for w in words)


def only_regex(name: str) -> str:
    """An --only pattern (re.search) that selects the step called ``name`` and no other."""
    return f"^{re.escape(name)}$"
