"""Records of submitted jobs, so that ``slipstream status|logs|cancel NAME`` find them again.

``slipstream submit`` writes one small JSON file per submission into the state
directory: ``$SLIPSTREAM_STATE_DIR`` if set, else ``$XDG_STATE_HOME/slipstream/jobs``
(``~/.local/state/slipstream/jobs`` when XDG_STATE_HOME is unset). A record names
the target (``slurm``, or a Kubernetes target such as ``jobset``), the engine's id
for the job (the Slurm job id; the Job name on Kubernetes), and where to look
(namespace, run directory, the spec file).

A job name may be submitted many times; lookups by name return the most recent
record. The engine id is unique per engine, so a lookup by id is exact.

Example::

    record_submission(name="gpt-small", target="slurm", engine_id="42", run_dir="/runs/gpt")
    find_submission("gpt-small").engine_id   # '42'
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import SlipstreamError

_FORMAT = 1


class SubmissionNotFound(SlipstreamError):
    """No submission record matches a job name or engine id (exit 2)."""


@dataclass(frozen=True)
class Submission:
    """One submitted job, as recorded by ``slipstream submit``."""

    name: str
    target: str
    engine_id: str
    submitted_at: float
    namespace: str | None = None
    run_dir: str | None = None
    spec_path: str | None = None
    path: str = ""  # the record file itself (not stored in it)


def state_dir() -> Path:
    """Where submission records live (``$SLIPSTREAM_STATE_DIR``, else the XDG state directory)."""
    explicit = os.environ.get("SLIPSTREAM_STATE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "slipstream" / "jobs"


def record_submission(*, name: str, target: str, engine_id: str, namespace: str | None = None,
                      run_dir: str | None = None, spec_path: str | None = None) -> Path:
    """Write the record of one submission (atomically: temporary file, then rename); return its path.

    Example::

        record_submission(name="gpt", target="jobset", engine_id="gpt", namespace="ml")
    """
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    now = time.time()
    record = {
        "format": _FORMAT, "name": name, "target": target, "engine_id": str(engine_id),
        "submitted_at": now, "namespace": namespace,
        "run_dir": None if run_dir is None else str(Path(run_dir).expanduser().absolute()),
        "spec_path": None if spec_path is None else str(Path(spec_path).expanduser().absolute()),
    }
    # The file name sorts by time and stays unique for two submissions in the same second.
    stem = (f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}.{int(now * 1e6) % 1_000_000:06d}"
            f"-{_safe(target)}-{_safe(str(engine_id))}")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        final = directory / f"{stem}.json"
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def list_submissions() -> list[Submission]:
    """Every readable record, oldest first (unreadable or foreign files are skipped)."""
    directory = state_dir()
    if not directory.is_dir():
        return []
    found = []
    for path in directory.glob("*.json"):
        if path.name.startswith(".tmp-"):
            continue
        sub = _load(path)
        if sub is not None:
            found.append(sub)
    found.sort(key=lambda s: (s.submitted_at, s.path))
    return found


def find_submission(key: str) -> Submission:
    """The submission whose engine id or job name is ``key`` (the most recent one for a reused name).

    An engine id match wins over a name match. Raises :class:`SubmissionNotFound`
    (exit 2) when nothing matches.

    Example::

        find_submission("gpt-small").target   # 'slurm'
    """
    subs = list_submissions()
    for by in ("engine_id", "name"):
        matches = [s for s in subs if getattr(s, by) == key]
        if matches:
            return matches[-1]
    where = state_dir()
    hint = ""
    names = sorted({s.name for s in subs})
    if names:
        import difflib

        close = difflib.get_close_matches(key, names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; recorded: {', '.join(names[-5:])}"
    raise SubmissionNotFound(
        f"no submitted job {key!r} in {where}{hint}; pass --target slurm with a Slurm job id, "
        "or --target kubernetes with a job name, to look it up on the cluster directly")


def _load(path: Path) -> Submission | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Submission(
            name=str(data["name"]), target=str(data["target"]), engine_id=str(data["engine_id"]),
            submitted_at=float(data["submitted_at"]), namespace=data.get("namespace"),
            run_dir=data.get("run_dir"), spec_path=data.get("spec_path"), path=str(path))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:60] or "_"


__all__ = ["Submission", "SubmissionNotFound", "find_submission", "list_submissions",
           "record_submission", "state_dir"]
