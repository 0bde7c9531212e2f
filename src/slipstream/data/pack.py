"""Turn raw data into shards: a directory of files, a text corpus, numpy arrays.

* ``pack_files``: one sample per file (its bytes), keyed by relative path.
* ``pack_text``: byte-level tokens. Every document's UTF-8 bytes are tokens
  0..255, documents are joined by the end-of-text token 256 (vocabulary 257,
  stored as uint16), and the stream is cut into samples of
  ``tokens_per_sample`` tokens (use ``x = s[:-1], y = s[1:]`` for next-token
  prediction). The tail shorter than one sample is dropped.
* ``pack_arrays``: rows of a ``.npy`` array (one field) or of the arrays of an
  ``.npz`` sharing their first dimension (one field each).
* ``pack_jsonl`` / ``pack_parquet`` (in ``ingest.py``): a text field of JSON
  Lines, a text or binary column of Parquet, optionally through a tokenizer.

Example::

    index = pack_text(sysconfig.get_paths()["stdlib"], "/data/stdlib-tokens", tokens_per_sample=257)
"""

from __future__ import annotations

import os
from typing import Iterator, Sequence

import numpy as np

from ..errors import ConfigError
from .format import DEFAULT_SHARD_SIZE_BYTES, Index, ShardWriter
from .ingest import EOT_TOKEN, JSONL_SUFFIXES, PARQUET_SUFFIXES, TEXT_VOCAB_SIZE, pack_jsonl, pack_parquet, walk_files

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".xml", ".c", ".h")


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
    files = walk_files(input_dir, suffixes, exclude_dirs)
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
        paths = walk_files(input_path, suffixes, exclude_dirs)
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


def _guess_kind(input_path: str) -> str:
    if input_path.endswith((".npy", ".npz")):
        return "arrays"
    if input_path.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if input_path.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if os.path.isdir(input_path):
        return "files"
    if os.path.isfile(input_path):
        return "text"
    raise ConfigError(f"{input_path} does not exist")


_OPTIONS = {  # kind -> the options it takes besides shard_size_bytes and the writer's
    "files": {"suffixes", "exclude_dirs"},
    "text": {"tokens_per_sample", "suffixes", "exclude_dirs", "max_bytes"},
    "arrays": set(),
    "jsonl": {"field", "tokens_per_sample", "tokenizer", "tokenizer_name", "eot_token"},
    "parquet": {"field", "tokens_per_sample", "tokenizer", "tokenizer_name", "eot_token"},
}
_WRITER_OPTIONS = {"shard_size_bytes", "overwrite", "storage_options"}


def pack(input_path: str, out: str, *, kind: str = "auto", **kw) -> Index:
    """Pick the packer from INPUT: ``.npy``/``.npz`` -> arrays, ``.jsonl``/``.ndjson`` -> jsonl,
    ``.parquet``/``.pq`` -> parquet, a directory -> files, another file -> text.

    ``kind`` ("files", "text", "arrays", "jsonl", "parquet") overrides the guess,
    e.g. a directory of text files packs as one token stream with ``kind="text"``
    and a directory of ``.jsonl`` files with ``kind="jsonl"``. Options that are
    ``None`` are left at the packer's default.

    Example::

        pack("train.jsonl", "/data/train", field="body", tokens_per_sample=513)
    """
    if kind == "auto":
        kind = _guess_kind(input_path)
    packers = {"files": pack_files, "text": pack_text, "arrays": pack_arrays, "jsonl": pack_jsonl, "parquet": pack_parquet}
    if kind not in packers:
        raise ConfigError(f"kind must be one of auto, {', '.join(packers)}; got {kind!r}")
    kw = {k: v for k, v in kw.items() if v is not None and v != ()}
    for k in kw:
        if k not in _OPTIONS[kind] | _WRITER_OPTIONS:
            takers = [name for name, opts in _OPTIONS.items() if k in opts]
            raise ConfigError(f"{k} applies to kind {' or '.join(map(repr, takers)) or '(none)'}, not {kind!r}")
    return packers[kind](input_path, out, **kw)
