"""One name per setting: the deprecated spellings, and what replaced them, in one table.

Every setting has one live name per place it can be written, and the places agree:

* a training option has one flat name (``checkpoint_every_steps``): the keyword of
  :func:`slipstream.accelerate`, the ``SLIPSTREAM_CHECKPOINT_EVERY_STEPS`` variable, the flag
  ``--checkpoint-every-steps`` and a flat key of the run config; and one nested path
  (``checkpoint.every_steps``): TrainConfig's section and field, the run config's sections and
  the job spec's sections alike (see :mod:`slipstream.config`);
* a launcher setting has the flag's name: ``--nproc-per-node`` is ``nproc_per_node`` in a run
  config (``launch.nproc_per_node`` nested);
* a flag means one thing in every sub-command: ``-n`` is processes per node (``run``, ``bench``),
  ``--json`` prints JSON (``plan``, ``bench``), ``--target`` is where a job runs.

An old spelling still works for one release: the parser that meets it (run config, job spec, a
flag) maps it to the new name through :data:`DEPRECATED` and prints one line, once per process,
naming the new one (:func:`warn_deprecated`). A spelling that would give a name two meanings is
refused instead, with a line naming the one to use (:data:`REFUSED`).

Example::

    rename_nested({"sync": {"precision": "bf16"}}, RUN_CONFIG, "run.yaml")
    # stderr: slipstream: warning: run.yaml: sync.precision is deprecated (goes in 0.2); write numerics.precision
    # -> {"numerics": {"precision": "bf16"}}
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Mapping

RUN_CONFIG = "run config"
JOB_SPEC = "job spec"
FLAG = "flag"
EXAMPLE = "example flag"
SURFACES = (RUN_CONFIG, JOB_SPEC, FLAG, EXAMPLE)
"""Where a name is written: a run config key, a job spec key, a ``slipstream`` flag, a flag of
the scripts in examples/."""

REMOVED_IN = "0.2"
"""The release that refuses the deprecated spellings (they warn in 0.1)."""


@dataclass(frozen=True)
class Deprecated:
    """An old spelling of a setting, still accepted (with one warning line) on ``surfaces``."""

    old: str
    """As written: a dotted key path (``checkpoint.interval_steps``) or a flag (``--checkpoint-every``)."""
    new: str
    """The live name to write instead."""
    surfaces: tuple[str, ...]
    commands: tuple[str, ...] = ()
    """For flags: the sub-commands where ``old`` is the old spelling (empty: every one)."""


@dataclass(frozen=True)
class Refused:
    """A spelling refused where it would give one name two meanings; the message names the live one."""

    old: str
    new: str
    commands: tuple[str, ...]
    why: str


DEPRECATED: tuple[Deprecated, ...] = (
    # The job spec's names for TrainConfig's fields, now TrainConfig's own (the run config takes
    # them too, so a section pasted from an older job spec still reads).
    Deprecated("checkpoint.interval_steps", "checkpoint.every_steps", (JOB_SPEC, RUN_CONFIG)),
    Deprecated("checkpoint.interval_s", "checkpoint.every_s", (JOB_SPEC, RUN_CONFIG)),
    Deprecated("sync.precision", "numerics.precision", (JOB_SPEC, RUN_CONFIG)),
    Deprecated("sync.accumulate_steps", "numerics.accumulate_steps", (JOB_SPEC, RUN_CONFIG)),
    # The examples' own flag for the checkpoint interval, now the launcher's spelling.
    Deprecated("--checkpoint-every", "--checkpoint-every-steps", (EXAMPLE,)),
    # `slipstream bench --json PATH` wrote a file where `plan --json` prints: the file is --json-out.
    Deprecated("--json PATH", "--json-out PATH", (FLAG,), commands=("bench",)),
)
"""Every deprecated spelling, in one place; the parsers read it, tests/config/test_names.py checks it."""

REFUSED: tuple[Refused, ...] = (
    Refused("-n", "--namespace", ("status", "logs", "cancel"),
            "-n is processes per node (slipstream run -n, bench -n)"),
)

_WARNED: set[tuple[str, str]] = set()


def warn_deprecated(old: str, new: str, where: str = "") -> None:
    """One line on stderr, once per process per spelling (on rank 0 only, in workers), naming the live name.

    Example::

        warn_deprecated("--checkpoint-every", "--checkpoint-every-steps")
        # slipstream: warning: --checkpoint-every is deprecated (goes in 0.2); write --checkpoint-every-steps
    """
    if (old, where) in _WARNED or os.environ.get("RANK", "0") != "0":  # a script's flag: rank 0 says it for all
        return
    _WARNED.add((old, where))
    prefix = f"{where}: " if where else ""
    sys.stderr.write(f"slipstream: warning: {prefix}{old} is deprecated (goes in {REMOVED_IN}); write {new}\n")
    sys.stderr.flush()


def nested_aliases(surface: str) -> dict[str, str]:
    """Old dotted key -> new dotted key, for the run config or the job spec."""
    return {d.old: d.new for d in DEPRECATED if surface in d.surfaces and not d.old.startswith("-")}


def rename_nested(doc: Mapping[Any, Any], surface: str, source: str = "",
                  renamed: dict[str, str] | None = None) -> dict[Any, Any]:
    """A copy of ``doc`` (a run config or job spec mapping) with its deprecated keys renamed, each warned
    about once. The new key given too is an error: :class:`ValueError` ``"old and new are the same
    setting; keep new"`` (the caller words it as its own error). ``renamed`` (if given) collects
    new -> old for the keys renamed, so errors can name the key as written.

    Example::

        rename_nested({"checkpoint": {"dir": "/c", "interval_steps": 5}}, JOB_SPEC)
        # {"checkpoint": {"dir": "/c", "every_steps": 5}}
    """
    out: dict[Any, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in doc.items()}
    for old, new in nested_aliases(surface).items():
        old_section, old_key = old.split(".")
        new_section, new_key = new.split(".")
        part = out.get(old_section)
        if not isinstance(part, dict) or old_key not in part:
            continue
        target = out.get(new_section)
        if target is None:
            target = out[new_section] = {}
        if not isinstance(target, dict):
            continue  # the new section is not a mapping: the reader reports it
        if new_key in target:
            raise ValueError(f"{old} and {new} are the same setting; keep {new}")
        warn_deprecated(old, new, source)
        target[new_key] = part.pop(old_key)
        if renamed is not None:
            renamed[new] = old
    return out


def renamed_flag(new_value: Any, old_value: Any, old: str) -> Any:
    """A script's flag under its new name, or under the old one (``old``, an :data:`EXAMPLE` entry of
    :data:`DEPRECATED`) with one warning line; for scripts that declare both with argparse.

    Example::

        p.add_argument("--checkpoint-every-steps", type=int)
        p.add_argument("--checkpoint-every", type=int, help=argparse.SUPPRESS)   # the old name, until 0.2
        args = p.parse_args()
        every = renamed_flag(args.checkpoint_every_steps, args.checkpoint_every, "--checkpoint-every")
    """
    if old_value is None:
        return new_value
    entry = next(d for d in DEPRECATED if d.old == old and EXAMPLE in d.surfaces)
    warn_deprecated(old, entry.new)
    return old_value if new_value is None else new_value


def deprecated_flag(flag: str, command: str) -> Deprecated | None:
    """The table's entry for ``flag`` in ``command`` (None: a live flag)."""
    for d in DEPRECATED:
        if d.old == flag and FLAG in d.surfaces and (not d.commands or command in d.commands):
            return d
    return None


__all__ = ["DEPRECATED", "REFUSED", "Deprecated", "Refused", "SURFACES", "RUN_CONFIG", "JOB_SPEC", "FLAG", "EXAMPLE",
           "REMOVED_IN", "warn_deprecated", "nested_aliases", "rename_nested", "renamed_flag", "deprecated_flag"]
