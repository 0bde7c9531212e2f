"""Integrity of committed checkpoints: what the marker records, and the check at load.

At commit, the ``COMMITTED`` marker lists every file of the checkpoint with its
size and a CRC-32 (``zlib.crc32``: in the standard library, about 2.5 GB/s on
this project's CPUs, so checksumming is cheaper than writing the bytes). At
load, rank 0 checks a checkpoint before choosing it:

* ``full`` (default): every listed file is present, has its recorded size and
  its recorded checksum (when recorded: a run with ``size`` or ``off`` records
  sizes only, to spare the save the second pass over its bytes);
* ``size``: present with its recorded size (catches truncation and missing
  files; reads nothing but directory entries);
* ``off``: no check beyond the marker being readable.

In every mode, per-rank files (``rank<R>.pt``) must agree with the marker's
world size: a marker that does not belong to the files beside it (copied from
another run, or from another world size) fails. Markers written before file
lists existed still load; their files can only be matched to the world size.

In an object store (a URL ``checkpoint_dir``, :mod:`.remote`) the same checks
run on the objects: sizes from one listing, checksums by reading each object
back (``full``: a download of the checkpoint at save and again at load; use
``size`` where that costs too much). A checkpoint moved aside there is copied
to ``step_N.corrupt-<time>/`` and then deleted, marker first.

Example::

    problem = check(layout.find_latest("ckpt"), "full")
    if problem.failed: print(problem.reason)
"""

from __future__ import annotations

import logging
import os
import re
import time
import zlib
from dataclasses import dataclass
from typing import Any

from ..config import CHECKPOINT_VERIFY_MODES as VERIFY_MODES
from . import remote
from .layout import MARKER, CheckpointDir, list_complete

log = logging.getLogger("slipstream.checkpoint")
_CHUNK_BYTES = 8 << 20  # large reads: checksum speed, not syscalls, sets the pace
_RANK_FILE = re.compile(r"^rank(\d+)\.pt$")


@dataclass(frozen=True)
class Verdict:
    """What :func:`check` found: ``reason`` is None when the checkpoint may be loaded."""

    reason: str | None = None
    unrecorded: bool = False  # an old marker without a file list: sizes and checksums unknown

    @property
    def failed(self) -> bool:
        return self.reason is not None


def file_crc32(path: str, fs: Any = None) -> int:
    """CRC-32 of a file's bytes (an object's, with an fsspec ``fs``), read in large chunks.

    Example::

        file_crc32("ckpt/step_00000100/__0_0.distcp")   # 3735928559
    """
    if fs is not None:
        crc = 0
        with fs.open(path, "rb", block_size=_CHUNK_BYTES) as f:
            while chunk := f.read(_CHUNK_BYTES):
                crc = zlib.crc32(chunk, crc)
        return crc
    buffer = bytearray(_CHUNK_BYTES)  # one buffer, refilled: no allocation per chunk
    view, crc = memoryview(buffer), 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return crc


def describe_files(directory: str, checksums: bool = True, fs: Any = None) -> dict[str, dict]:
    """Every file under ``directory`` (the marker aside) as ``{relative path: {"bytes", "crc32"}}``;
    with an fsspec ``fs``, every object under the prefix ``directory``.

    Example::

        describe_files("ckpt/step_00000100.partial")
        # {".metadata": {"bytes": 1234, "crc32": "9a0c3f11"}, "__0_0.distcp": {...}, "rank0.pt": {...}}
    """
    out: dict[str, dict] = {}
    if fs is not None:
        for rel, size in remote.objects(fs, directory).items():
            if rel not in (MARKER, MARKER + ".tmp"):
                out[rel] = {"bytes": size}
                if checksums:
                    out[rel]["crc32"] = f"{file_crc32(remote.join(directory, rel), fs):08x}"
        return dict(sorted(out.items()))
    for root, _dirs, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, directory)
            if rel in (MARKER, MARKER + ".tmp"):
                continue
            entry: dict = {"bytes": os.path.getsize(path)}
            if checksums:
                entry["crc32"] = f"{file_crc32(path):08x}"
            out[rel] = entry
    return dict(sorted(out.items()))


def checkpoint_bytes(info: dict) -> int | None:
    """Total size of a checkpoint from its marker, or None for a marker without a file list."""
    files = info.get("files")
    if not isinstance(files, dict):
        return None
    return sum(int(entry.get("bytes", 0)) for entry in files.values())


def check(ckpt: CheckpointDir, mode: str = "full") -> Verdict:
    """Whether ``ckpt`` may be loaded, checked as ``mode`` says (see the module docstring).

    Example::

        verdict = check(CheckpointDir("ckpt/step_00000030", 30), "size")
        verdict.reason   # "__1_0.distcp: 4096 bytes, the marker recorded 8192 (truncated)"
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"checkpoint_verify must be one of {', '.join(VERIFY_MODES)}, got {mode!r}")
    try:
        info = ckpt.info
    except (OSError, ValueError) as exc:
        return Verdict(f"{MARKER} cannot be read ({exc})")
    if not isinstance(info, dict) or not isinstance(info.get("world_size"), int):
        return Verdict(f"{MARKER} does not hold a world size")
    files = info.get("files")
    sizes = remote.objects(ckpt.fs, ckpt.path) if ckpt.fs is not None else None  # one listing of the prefix
    reason = _rank_files_problem(ckpt.path, info["world_size"], files, sizes)
    if reason or mode == "off":
        return Verdict(reason)
    if not isinstance(files, dict):
        return Verdict(None, unrecorded=True)
    for rel, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
            return Verdict(f"{MARKER}: the entry of {rel} is malformed ({entry!r})")
        path = os.path.join(ckpt.path, rel)
        try:
            found = os.path.getsize(path) if sizes is None else sizes[rel]
        except (OSError, KeyError):
            return Verdict(f"{rel}: missing (the marker recorded {entry['bytes']} bytes)")
        if found != entry["bytes"]:
            how = "truncated" if found < entry["bytes"] else "longer than written"
            return Verdict(f"{rel}: {found} bytes, the marker recorded {entry['bytes']} ({how})")
        if mode == "full" and "crc32" in entry:
            try:
                crc = f"{file_crc32(path, ckpt.fs):08x}"
            except OSError as exc:  # an I/O error: the same verdict as a bad checksum
                return Verdict(f"{rel}: cannot be read ({exc})")
            if crc != entry["crc32"]:
                return Verdict(f"{rel}: checksum crc32 {crc}, the marker recorded {entry['crc32']} (contents changed)")
    return Verdict(None)


def choose_newest(root: str, mode: str, fs: Any = None) -> tuple[str, int, int] | str | None:
    """The newest checkpoint under ``root`` that passes :func:`check`, as (path, step,
    world size). Each one that fails is logged (which file, how) and moved aside.
    Returns a message instead when checkpoints existed and none verifies (or only
    moved-aside ones are left), and None when there never were any. ``fs``: the
    fsspec filesystem of an object-store ``root``.

    Example::

        choose_newest("ckpt", "full")   # ("ckpt/step_00000020", 20, 2) when step 30 is damaged
    """
    if fs is None and remote.is_url(root):
        fs = remote.filesystem(root)
    failed = []
    for ckpt in reversed(list_complete(root, fs)):
        verdict = check(ckpt, mode)
        if not verdict.failed:
            if verdict.unrecorded:
                log.info("checkpoint %s has a marker without a file list (written by an earlier version): "
                         "file sizes and checksums cannot be checked", ckpt.path)
            return ckpt.path, ckpt.step, ckpt.info["world_size"]
        failed.append(os.path.basename(ckpt.path))
        try:
            moved = "moved aside to " + os.path.basename(move_aside(ckpt.path, fs))
        except OSError as exc:
            moved = f"could not be moved aside ({exc}), skipped"
        log.error("checkpoint %s failed verification (checkpoint_verify=%s): %s; %s, trying the previous one",
                  ckpt.path, mode, verdict.reason, moved)
    aside = moved_aside(root, fs)
    unmoved = [name for name in failed if not any(a.startswith(name + ".corrupt-") for a in aside)]
    if failed or aside:
        return (f"checkpoint_dir {root} holds no checkpoint that verifies (failed: {', '.join(aside + unmoved)}); "
                "refusing to start from scratch over it: restore a good checkpoint there, or point "
                "checkpoint_dir at an empty directory to start over")
    return None


def _rank_files_problem(path: str, world_size: int, files: dict | None, objects: dict | None = None) -> str | None:
    """Per-rank files must be rank0.pt .. rank<W-1>.pt for the marker's world size W
    (or absent altogether: a run with no per-rank state writes none). ``objects``:
    an object store's listing of the checkpoint instead of the directory's."""
    names = os.listdir(path) if objects is None else list(objects)
    present = {int(m.group(1)) for name in names if (m := _RANK_FILE.match(name))}
    expected = set(range(world_size))
    if isinstance(files, dict):
        listed = {int(m.group(1)) for rel in files if (m := _RANK_FILE.match(rel))}
        if listed and listed != expected:
            return (f"{MARKER} says world_size {world_size} but lists per-rank files for ranks "
                    f"{_ranks(listed)}: the marker does not belong to these files")
        unlisted = present - listed
        if unlisted:
            return (f"rank{min(unlisted)}.pt is not in the marker (world_size {world_size}): "
                    "the marker does not belong to these files")
        return None
    if present and present != expected:
        return (f"{MARKER} says world_size {world_size} but the per-rank files are for ranks {_ranks(present)}: "
                "the marker does not belong to these files")
    return None


def _ranks(ranks: set[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def move_aside(path: str, fs: Any = None) -> str:
    """Rename a checkpoint that failed verification to ``<path>.corrupt-<UTC time>``
    (never deleted: it may hold the only copy of a long run's work). Returns the new path.
    In an object store (``fs``): every object is copied there first, then the
    original is deleted, marker first (a cut between the two leaves both).

    Example::

        move_aside("ckpt/step_00000030")   # "ckpt/step_00000030.corrupt-20261130T140501"
    """
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target, n = f"{path}.corrupt-{stamp}", 1
    exists = os.path.exists if fs is None else (lambda p: bool(remote.objects(fs, p)))
    while exists(target):
        n += 1
        target = f"{path}.corrupt-{stamp}-{n}"
    if fs is None:
        os.replace(path, target)
        return target
    for rel in remote.objects(fs, path):
        fs.copy(remote.join(path, rel), remote.join(target, rel))
    remote.remove(fs, path, first=MARKER)
    return target


def moved_aside(root: str, fs: Any = None) -> list[str]:
    """Checkpoints moved aside by earlier runs (names ``step_<N>.corrupt-<time>``)."""
    if fs is not None:
        names = {rel.partition("/")[0] for rel in remote.objects(fs, root)}
    elif not os.path.isdir(root):
        return []
    else:
        names = set(os.listdir(root))
    return sorted(n for n in names if re.match(r"^step_\d{8,}\.corrupt-", n))
