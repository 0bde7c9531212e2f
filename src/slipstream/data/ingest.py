"""Pack the formats datasets come in: JSON Lines and Parquet.

* ``pack_jsonl``: one document per line, its text in ``field`` (default
  ``"text"``).
* ``pack_parquet``: one document per row of the column ``field``. A string
  column is text; a binary column gives one raw ``bytes`` sample per row.

Text becomes token samples of ``tokens_per_sample`` tokens, cut from one
stream of documents. Without a tokenizer the tokens are the byte-level ones of
``pack_text`` (UTF-8 bytes, end-of-text 256 between documents, uint16). With
``tokenizer`` (any callable ``str -> list[int] | np.ndarray``, e.g. a Hugging
Face tokenizer's ``encode``), its tokens are stored as uint32, followed by
``eot_token`` when one is given.

Bad input is a ``ConfigError`` (exit 2) whose one line names the file and the
line (JSON Lines, from 1) or the row (Parquet, from 0); the writer then
publishes nothing (see ``ShardWriter``).

Example::

    pack_jsonl("train.jsonl", "/data/train-tokens", field="text", tokens_per_sample=1025)
    pack_parquet("images.parquet", "s3://bucket/images", field="jpeg")        # binary column
    pack_jsonl("docs/", "/data/docs", tokenizer=load_callable("tiktoken_shim:encode"), eot_token=100257)
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Callable, Iterator, Sequence

import numpy as np

from ..errors import ConfigError, UsageError
from ..extras import pip_install_hint
from .format import DEFAULT_SHARD_SIZE_BYTES, Index, ShardWriter

Tokenizer = Callable[[str], "list[int] | np.ndarray"]

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
EOT_TOKEN = 256  # byte-level tokens: UTF-8 bytes 0..255, then end-of-text
TEXT_VOCAB_SIZE = 257


def walk_files(root: str, suffixes: Sequence[str] | None = None, exclude_dirs: Sequence[str] = ()) -> list[str]:
    """Regular files under root, sorted by relative path (so packing is deterministic).

    Directories whose name is in ``exclude_dirs`` are not entered.

    Example::

        walk_files("corpus/", suffixes=(".jsonl",))  # ["corpus/a.jsonl", "corpus/sub/b.jsonl"]
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


def load_callable(spec: str) -> Tokenizer:
    """``"package.module:name"`` -> the callable it names (attribute paths like ``mod:obj.encode`` work).

    Example::

        encode = load_callable("my_tokenizers:gpt2_encode")
        encode("hello")  # -> [31373]
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"tokenizer must be MODULE:CALLABLE (e.g. my_pkg.tok:encode), got {spec!r}")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"tokenizer {spec!r}: cannot import {module_name!r} ({exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"tokenizer {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"tokenizer {spec!r}: {attr!r} is not callable")
    return obj


def _inputs(input_path: str, suffixes: Sequence[str], what: str) -> list[str]:
    if os.path.isdir(input_path):
        paths = walk_files(input_path, suffixes)
        if not paths:
            raise ConfigError(f"{input_path}: no {what} files (suffixes {list(suffixes)})")
        return paths
    if os.path.isfile(input_path):
        return [input_path]
    raise ConfigError(f"{input_path} does not exist")


def _tokens(text: str, tokenizer: Tokenizer | None, eot: np.ndarray, where: str) -> np.ndarray:
    if tokenizer is None:
        return np.concatenate([np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8).astype(np.uint16), eot])
    try:
        toks = np.asarray(tokenizer(text))
    except Exception as exc:  # noqa: BLE001 - a user's tokenizer: any failure is reported with its place
        raise ConfigError(f"{where}: the tokenizer failed: {type(exc).__name__}: {exc}") from None
    if toks.ndim != 1 or (toks.size and toks.dtype.kind not in "iu"):
        raise ConfigError(f"{where}: the tokenizer returned {toks.dtype} of shape {toks.shape}, expected a flat list of ints")
    if toks.size and (int(toks.min()) < 0 or int(toks.max()) > np.iinfo(np.uint32).max):
        raise ConfigError(f"{where}: the tokenizer returned ids outside [0, 2**32)")
    return np.concatenate([toks.astype(np.uint32), eot])


class _TokenPacker:
    """Cuts a stream of documents' tokens into fixed-size samples written to ``w``."""

    def __init__(self, w: ShardWriter, tokens_per_sample: int, dtype: np.dtype):
        self.w, self.n, self.buf, self.written = w, tokens_per_sample, np.empty(0, dtype=dtype), 0

    def add(self, toks: np.ndarray) -> None:
        self.buf = np.concatenate([self.buf, toks])
        k = len(self.buf) // self.n
        for i in range(k):
            self.w.write(self.buf[i * self.n : (i + 1) * self.n])
        self.written += k
        self.buf = self.buf[k * self.n :]


def _pack_documents(
    docs: Iterator[tuple[str, str | bytes]],
    first_kind: str,
    out: str,
    input_path: str,
    *,
    tokens_per_sample: int,
    tokenizer: Tokenizer | None,
    tokenizer_name: str | None,
    eot_token: int | None,
    shard_size_bytes: int,
    source_format: str,
    **writer_kw,
) -> Index:
    """``docs`` yields (where, text-or-bytes); ``first_kind`` ("text"/"binary") fixes the dataset's kind."""
    if first_kind == "binary":
        if tokenizer is not None:
            raise ConfigError(f"{input_path}: a binary column is packed as raw bytes; --tokenizer applies to text")
        meta = {"kind": "records", "source_format": source_format}
        with ShardWriter(out, shard_size_bytes=shard_size_bytes, meta=meta, **writer_kw) as w:
            for where, value in docs:
                if not isinstance(value, (bytes, bytearray, memoryview)):
                    raise ConfigError(f"{where}: expected bytes, got {type(value).__name__}")
                w.write(value)
        return w.index
    if tokens_per_sample < 2:
        raise ConfigError(f"tokens_per_sample must be at least 2, got {tokens_per_sample}")
    if tokenizer is None:
        dtype, eot = np.dtype(np.uint16), np.array([EOT_TOKEN], dtype=np.uint16)
        meta = {"kind": "text", "tokenizer": "bytes+eot", "vocab_size": TEXT_VOCAB_SIZE, "eot_token": EOT_TOKEN}
    else:
        dtype = np.dtype(np.uint32)
        eot = np.array([] if eot_token is None else [eot_token], dtype=np.uint32)
        meta = {"kind": "text", "tokenizer": tokenizer_name or getattr(tokenizer, "__qualname__", repr(tokenizer)), "eot_token": eot_token}
    meta["source_format"] = source_format
    fields = [("tokens", dtype.str, (tokens_per_sample,))]
    with ShardWriter(out, shard_size_bytes=shard_size_bytes, fields=fields, meta=meta, **writer_kw) as w:
        packer = _TokenPacker(w, tokens_per_sample, dtype)
        for where, value in docs:
            if not isinstance(value, str):
                raise ConfigError(f"{where}: expected a string, got {type(value).__name__}")
            packer.add(_tokens(value, tokenizer, eot, where))
        if packer.written == 0:
            raise ConfigError(f"{input_path}: fewer than tokens_per_sample({tokens_per_sample}) tokens of text")
    return w.index


def _jsonl_docs(paths: Sequence[str], field: str) -> Iterator[tuple[str, str]]:
    for path in paths:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                where = f"{path}:{lineno}"
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except UnicodeDecodeError as exc:
                    raise ConfigError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start} of the line)") from None
                except ValueError as exc:
                    cut = "" if raw.endswith(b"\n") else " (the file ends inside this line: truncated?)"
                    raise ConfigError(f"{where}: not valid JSON: {exc}{cut}") from None
                if not isinstance(rec, dict):
                    raise ConfigError(f"{where}: expected a JSON object, got {type(rec).__name__}")
                if field not in rec:
                    keys = ", ".join(sorted(rec)[:8])
                    raise ConfigError(f"{where}: no field {field!r} (the record has: {keys or 'nothing'}; choose with --field)")
                yield where, rec[field]


def pack_jsonl(
    input_path: str,
    out: str,
    *,
    field: str = "text",
    tokens_per_sample: int = 1025,
    tokenizer: Tokenizer | None = None,
    tokenizer_name: str | None = None,
    eot_token: int | None = None,
    shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES,
    **writer_kw,
) -> Index:
    """Token samples from the ``field`` of every line of a JSON Lines file (or a directory of them).

    Example::

        idx = pack_jsonl("train.jsonl", "/data/train-tokens", field="text", tokens_per_sample=257)
    """
    paths = _inputs(input_path, JSONL_SUFFIXES, "JSON Lines")
    return _pack_documents(
        _jsonl_docs(paths, field), "text", out, input_path,
        tokens_per_sample=tokens_per_sample, tokenizer=tokenizer, tokenizer_name=tokenizer_name,
        eot_token=eot_token, shard_size_bytes=shard_size_bytes, source_format="jsonl", **writer_kw,
    )


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UsageError(f"reading Parquet needs pyarrow: {pip_install_hint('data')}") from None
    return pyarrow


def _parquet_kind(pa, paths: Sequence[str], field: str) -> str:
    kinds = set()
    for path in paths:
        schema = _open_parquet(pa, path).schema_arrow
        if field not in schema.names:
            raise ConfigError(f"{path}: no column {field!r} (columns: {', '.join(schema.names[:8])}; choose with --field)")
        t = schema.field(field).type
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            kinds.add("text")
        elif pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
            kinds.add("binary")
        else:
            raise ConfigError(f"{path}: column {field!r} is {t}; a string (text) or binary column is needed")
    if len(kinds) > 1:
        raise ConfigError(f"{paths[0]}...: column {field!r} is text in some files and binary in others")
    return kinds.pop()


def _open_parquet(pa, path: str):
    try:
        return pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{path}: not a readable Parquet file (truncated?): {exc}") from None


def _parquet_docs(pa, paths: Sequence[str], field: str, batch_rows: int = 1024) -> Iterator[tuple[str, str | bytes]]:
    for path in paths:
        pf = _open_parquet(pa, path)
        row = 0
        for group in range(pf.num_row_groups):
            rows = pf.metadata.row_group(group).num_rows
            try:
                table = pf.read_row_group(group, columns=[field])
            except (pa.ArrowException, OSError) as exc:
                raise ConfigError(f"{path}: row {row} (rows {row}..{row + rows - 1}, row group {group}) cannot be read: {exc}") from None
            for chunk in table.column(field).chunks:
                for value in chunk.to_pylist():
                    if value is None:
                        raise ConfigError(f"{path}: row {row}: column {field!r} is null")
                    yield f"{path}: row {row}", value
                    row += 1


def pack_parquet(
    input_path: str,
    out: str,
    *,
    field: str = "text",
    tokens_per_sample: int = 1025,
    tokenizer: Tokenizer | None = None,
    tokenizer_name: str | None = None,
    eot_token: int | None = None,
    shard_size_bytes: int = DEFAULT_SHARD_SIZE_BYTES,
    **writer_kw,
) -> Index:
    """Samples from the column ``field`` of a Parquet file (or a directory of them).

    A string column gives token samples (as ``pack_jsonl``); a binary column
    one raw ``bytes`` sample per row. Needs pyarrow (the ``data`` extra).

    Example::

        idx = pack_parquet("shard-0.parquet", "/data/tokens", field="content")
    """
    pa = _pyarrow()
    paths = _inputs(input_path, PARQUET_SUFFIXES, "Parquet")
    kind = _parquet_kind(pa, paths, field)
    return _pack_documents(
        _parquet_docs(pa, paths, field), kind, out, input_path,
        tokens_per_sample=tokens_per_sample, tokenizer=tokenizer, tokenizer_name=tokenizer_name,
        eot_token=eot_token, shard_size_bytes=shard_size_bytes, source_format="parquet", **writer_kw,
    )
