"""Turn raw data into shards: a directory of files, a text corpus, numpy arrays.

* ``pack_files``: one sample per file (its bytes), keyed by relative path.
* ``pack_text``: byte-level tokens. Every document's UTF-8 bytes are tokens
  0..255, documents are joined by the end-of-text token 256 (vocabulary 257,
  stored as uint16), and the stream is cut into samples of
  ``tokens_per_sample`` tokens (use ``x = s[:-1], y = s[1:]`` for next-token
  prediction). The tail shorter than one sample is dropped.
* ``pack_arrays``: rows of a ``.npy`` array (one field) or of the arrays of an
  ``.npz`` sharing their first dimension (one field each).

Example::

    index = pack_text(sysconfig.get_paths()["stdlib"], "/data/stdlib-tokens", tokens_per_sample=257)
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np

from ..errors import ConfigError
from .format import DEFAULT_SHARD_SIZE_BYTES, Index, ShardWriter

EOT_TOKEN = 256
TEXT_VOCAB_SIZE = 257
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".xml", ".c", ".h")


def _walk(root: str, suffixes: Sequence[str] | None = None, exclude_dirs: Sequence[str] = ()) -> list[str]:
    """Regular files under root, sorted by relative path (so packing is deterministic).

    Directories whose name is in ``exclude_dirs`` are not entered.
    """
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in set(exclude_dirs))
        for name in sorted(filenames):
            if suffixes is not None and not name.endswith(tuple(suffixes)):
                continue
            p = os.path.join(dirpath, name)
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(p)
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def pack_files(
    input_dir: str,
    out: str,
    *,
    shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES,
    suffixes: Sequence[str] | None = None,
    exclude_dirs: Sequence[str] = (),
    **writer_kw,
) -> Index:
    """One sample per file under ``input_dir`` (bytes), keys = relative paths.

    Example::

        idx = pack_files("images/", "/data/images-shards", suffixes=(".jpg",))
    """
    if not os.path.isdir(input_dir):
        raise ConfigError(f"{input_dir} is not a directory")
    files = _walk(input_dir, suffixes, exclude_dirs)
    if not files:
        raise ConfigError(f"{input_dir}: no files to pack")
    with ShardWriter(out, shard_size_bytes=shard_size_bytes, with_keys=True, meta={"kind": "files"}, **writer_kw) as w:
        for p in files:
            with open(p, "rb") as f:
                w.write(f.read(), key=os.path.relpath(p, input_dir))
    return w.index


def text_tokens(paths: Sequence[str], max_bytes: int | None = None) -> Iterator[np.ndarray]:
    """Byte-level token arrays (uint16) of each document, each followed by EOT."""
    total = 0
    eot = np.array([EOT_TOKEN], dtype=np.uint16)
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        if max_bytes is not None:
            data = data[: max(0, max_bytes - total)]
        total += len(data)
        yield np.concatenate([np.frombuffer(data, dtype=np.uint8).astype(np.uint16), eot])
        if max_bytes is not None and total >= max_bytes:
            return


def pack_text(
    input_path: str,
    out: str,
    *,
    tokens_per_sample: int = 1025,
    shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES,
    suffixes: Sequence[str] | None = TEXT_SUFFIXES,
    exclude_dirs: Sequence[str] = (),
    max_bytes: int | None = None,
    **writer_kw,
) -> Index:
    """Byte-level token samples from a text file or a directory of text files.

    ``max_bytes`` stops after that much text (for benchmarks and smoke tests);
    directories named in ``exclude_dirs`` are skipped (e.g. ``("site-packages", "test")``).

    Example::

        idx = pack_text("corpus/", "/data/corpus-tokens", tokens_per_sample=1025)
    """
    if tokens_per_sample < 2:
        raise ConfigError(f"tokens_per_sample must be at least 2, got {tokens_per_sample}")
    if os.path.isdir(input_path):
        paths = _walk(input_path, suffixes, exclude_dirs)
    elif os.path.isfile(input_path):
        paths = [input_path]
    else:
        raise ConfigError(f"{input_path} does not exist")
    if not paths:
        raise ConfigError(f"{input_path}: no text files (suffixes {list(suffixes or [])})")
    meta = {"kind": "text", "tokenizer": "bytes+eot", "vocab_size": TEXT_VOCAB_SIZE, "eot_token": EOT_TOKEN}
    fields = [("tokens", "uint16", (tokens_per_sample,))]
    buf = np.empty(0, dtype=np.uint16)
    written = 0
    with ShardWriter(out, shard_size_bytes=shard_size_bytes, fields=fields, meta=meta, **writer_kw) as w:
        for toks in text_tokens(paths, max_bytes):
            buf = np.concatenate([buf, toks])
            n = len(buf) // tokens_per_sample
            for k in range(n):
                w.write(buf[k * tokens_per_sample : (k + 1) * tokens_per_sample])
            written += n
            buf = buf[n * tokens_per_sample :]
        if written == 0:
            raise ConfigError(f"{input_path}: fewer than tokens_per_sample({tokens_per_sample}) tokens of text")
    return w.index


def pack_arrays(input_path: str, out: str, *, shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES, **writer_kw) -> Index:
    """Rows of a .npy array, or of the arrays of a .npz (one field each), as samples.

    Example::

        np.savez("train.npz", x=images, y=labels)
        idx = pack_arrays("train.npz", "/data/train-shards")
    """
    if input_path.endswith(".npy"):
        arrays = {"array": np.load(input_path, mmap_mode="r")}
    elif input_path.endswith(".npz"):
        with np.load(input_path) as z:
            arrays = {k: z[k] for k in z.files}
    else:
        raise ConfigError(f"{input_path}: pack_arrays reads .npy or .npz files")
    if not arrays:
        raise ConfigError(f"{input_path}: holds no arrays")
    lengths = {k: (a.shape[0] if a.ndim else 0) for k, a in arrays.items()}
    n = next(iter(lengths.values()))
    if n == 0 or any(v != n for v in lengths.values()):
        raise ConfigError(f"{input_path}: arrays need the same non-zero first dimension, got {lengths}")
    for k, a in arrays.items():
        if a.dtype.hasobject:
            raise ConfigError(f"{input_path}: array {k!r} holds Python objects; only plain dtypes can be packed")
    fields = [(k, a.dtype.str, a.shape[1:]) for k, a in arrays.items()]
    with ShardWriter(out, shard_size_bytes=shard_size_bytes, fields=fields, meta={"kind": "arrays"}, **writer_kw) as w:
        for i in range(n):
            w.write({k: a[i] for k, a in arrays.items()})
    return w.index


def pack(input_path: str, out: str, *, kind: str = "auto", **kw) -> Index:
    """Pick the packer: ``.npy``/``.npz`` -> arrays, a directory -> files, a file -> text.

    ``kind`` ("files", "text", "arrays") overrides the guess, e.g. a directory
    of text files packs as one token stream with ``kind="text"``.
    """
    if kind == "auto":
        if input_path.endswith((".npy", ".npz")):
            kind = "arrays"
        elif os.path.isdir(input_path):
            kind = "files"
        elif os.path.isfile(input_path):
            kind = "text"
        else:
            raise ConfigError(f"{input_path} does not exist")
    packers = {"files": pack_files, "text": pack_text, "arrays": pack_arrays}
    if kind not in packers:
        raise ConfigError(f"kind must be one of auto, {', '.join(packers)}; got {kind!r}")
    if kind != "text":
        if kind == "arrays" and kw.pop("exclude_dirs", None):
            raise ConfigError("exclude_dirs applies to directories (kind 'files' or 'text')")
        for k in ("tokens_per_sample", "max_bytes"):
            if kw.pop(k, None) is not None:
                raise ConfigError(f"{k} applies to kind='text' only")
    return packers[kind](input_path, out, **kw)
