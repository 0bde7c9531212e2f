"""``slipstream data``: pack, prewarm and verify datasets."""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import ConfigError, UsageError


def _storage_options(args: argparse.Namespace) -> dict:
    return {"endpoint_url": args.endpoint_url} if getattr(args, "endpoint_url", None) else {}


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return v

    return parse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "data",
        help="pack datasets into shards, prewarm a node cache, verify shards",
        description="Sharded, memory-mapped datasets: pack raw data, prewarm a node-local cache from an object store, verify.",
    )
    sub = p.add_subparsers(dest="data_command", metavar="ACTION")
    p.set_defaults(func=lambda args: _help(p))

    pk = sub.add_parser(
        "pack",
        help="pack files, text, JSON Lines, Parquet or numpy arrays into shards",
        description="INPUT: a directory (one sample per file, or --kind text|jsonl|parquet for the files in it), "
        "a text file (byte-level tokens), a .jsonl file (the text of --field), a .parquet file (a text or binary "
        "column named by --field), or a .npy/.npz file (rows). OUT: a directory or an fsspec URL.",
    )
    pk.add_argument("input", metavar="INPUT")
    pk.add_argument("out", metavar="OUT")
    pk.add_argument("--kind", choices=("auto", "files", "text", "arrays", "jsonl", "parquet"), default="auto", help="what INPUT holds (default: guess)")
    pk.add_argument("--shard-size-mb", type=_positive(float), default=64.0, metavar="MB", help="shard size in MiB (default 64)")
    pk.add_argument("--tokens-per-sample", type=_positive(int), default=None, metavar="N", help="text, jsonl, parquet: tokens per sample (default 1025)")
    pk.add_argument("--field", default=None, metavar="NAME", help="jsonl: the text field; parquet: the column (default text)")
    pk.add_argument(
        "--tokenizer", default=None, metavar="MODULE:CALLABLE",
        help="jsonl, parquet: a callable str -> list of token ids (default: byte-level tokens)",
    )
    pk.add_argument("--eot-token", type=int, default=None, metavar="ID", help="with --tokenizer: the id put after each document")
    pk.add_argument("--max-mb", type=_positive(float), default=None, metavar="MB", help="text: stop after this much text")
    pk.add_argument("--exclude-dir", action="append", default=[], metavar="NAME", help="skip directories with this name (repeatable)")
    pk.add_argument("--overwrite", action="store_true", help="replace an existing dataset at OUT")
    pk.add_argument("--endpoint-url", default=None, help="object-store endpoint (S3-compatible servers)")
    pk.set_defaults(func=main_pack)

    pw = sub.add_parser(
        "prewarm",
        help="download a dataset's shards into a node-local cache, in parallel",
        description="Fetch every shard of the dataset at URL into the cache directory, verifying each SHA-256.",
    )
    pw.add_argument("url", metavar="URL")
    pw.add_argument("--cache", required=True, metavar="DIR", help="node-local cache directory")
    pw.add_argument("--workers", type=_positive(int), default=8, metavar="N", help="parallel downloads (default 8)")
    pw.add_argument("--max-cache-gb", type=_positive(float), default=None, metavar="GB", help="cache size limit (LRU eviction)")
    pw.add_argument("--no-progress", action="store_true", help="no progress bar")
    pw.add_argument("--endpoint-url", default=None, help="object-store endpoint (S3-compatible servers)")
    pw.set_defaults(func=main_prewarm)

    vf = sub.add_parser("verify", help="check every shard's SHA-256 and every sample's CRC-32")
    vf.add_argument("url", metavar="URL")
    vf.add_argument("--cache", default=None, metavar="DIR", help="cache directory (needed for URLs)")
    vf.add_argument("--endpoint-url", default=None, help="object-store endpoint (S3-compatible servers)")
    vf.set_defaults(func=main_verify)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _io_errors(fn):
    """Object-store and file-system failures become one-line usage errors."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (OSError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise UsageError(f"{type(exc).__name__}: {exc}") from None

    return wrapped


def _is_url(text: str) -> bool:
    return "://" in text


def check_data_args(args: argparse.Namespace) -> None:
    """The paths and URLs of ``data pack | prewarm | verify`` before any data is read:
    each error names the argument, the rule and the value."""
    endpoint = getattr(args, "endpoint_url", None)
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise UsageError(f"--endpoint-url must be an http:// or https:// URL, got {endpoint!r}")
    cache = getattr(args, "cache", None)
    if cache is not None and os.path.exists(cache) and not os.path.isdir(cache):
        raise UsageError(f"--cache must be a directory, got a file: {cache}")
    source = getattr(args, "input", None)  # a dataset URL's own check says what is missing in it
    if source is not None and not _is_url(source) and not os.path.exists(source):
        raise UsageError(f"INPUT {source} does not exist")
    out = getattr(args, "out", None)
    if out is not None and not _is_url(out) and os.path.isfile(out):
        raise UsageError(f"OUT must be a directory (or a URL), got a file: {out}")


@_io_errors
def main_pack(args: argparse.Namespace) -> int:
    from .pack import pack

    check_data_args(args)

    kw = {}
    if args.tokens_per_sample is not None:
        kw["tokens_per_sample"] = args.tokens_per_sample
    if args.max_mb is not None:
        kw["max_bytes"] = int(args.max_mb * 1e6)
    if args.exclude_dir:
        kw["exclude_dirs"] = tuple(args.exclude_dir)
    if args.eot_token is not None and args.tokenizer is None:
        raise ConfigError("--eot-token goes with --tokenizer (byte-level tokens end documents with 256)")
    if args.tokenizer is not None:
        from .ingest import load_callable

        try:
            tokenizer = load_callable(args.tokenizer)
        except (ConfigError, UsageError) as exc:
            raise UsageError(f"--tokenizer: {exc}") from None
        kw["tokenizer"], kw["tokenizer_name"], kw["eot_token"] = tokenizer, args.tokenizer, args.eot_token
    if args.field is not None:
        kw["field"] = args.field
    index = pack(
        args.input,
        args.out,
        kind=args.kind,
        shard_size_bytes=int(args.shard_size_mb * (1 << 20)),
        overwrite=args.overwrite,
        storage_options=_storage_options(args),
        **kw,
    )
    print(f"{args.out}: {index.num_samples} samples in {len(index.shards)} shards, {index.total_bytes / 1e6:.1f} MB")
    return 0


@_io_errors
def main_prewarm(args: argparse.Namespace) -> int:
    check_data_args(args)
    from .cache import ShardCache, prewarm

    max_bytes = int(args.max_cache_gb * 1e9) if args.max_cache_gb else None
    cache = ShardCache(args.cache, max_bytes=max_bytes)
    report = prewarm(args.url, cache, workers=args.workers, storage_options=_storage_options(args), progress=not args.no_progress)
    print(report.summary())
    return 0


@_io_errors
def main_verify(args: argparse.Namespace) -> int:
    check_data_args(args)
    from .cache import ShardCache
    from .dataset import verify_dataset

    cache = ShardCache(args.cache) if args.cache else None
    errors = verify_dataset(args.url, cache=cache, storage_options=_storage_options(args))
    for e in errors:
        print(f"bad: {e}", file=sys.stderr)
    if errors:
        raise ConfigError(f"{len({e.shard for e in errors})} bad shard(s) in {args.url}")
    print(f"{args.url}: all shards verified")
    return 0
