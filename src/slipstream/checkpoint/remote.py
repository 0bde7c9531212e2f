"""Checkpoints in an object store: ``checkpoint_dir`` as an fsspec URL (``s3://``, ``gs://``, ``memory://`` ...).

An object store has no rename, so the local protocol (write ``step_N.partial/``,
then rename it) does not carry over: a "rename" there copies every object and
is not atomic. Instead each object of a checkpoint is written under its final
prefix ``step_N/`` and the commit is one more object, the ``COMMITTED`` marker,
put last by rank 0 once DCP's ``.metadata`` and every ``rank<R>.pt`` exist. One
put of a whole object is atomic on S3, GCS and Azure: a reader sees the marker
whole or not at all. A prefix without a marker is debris (a save killed during
the upload): never loaded, and deleted by the next prune. Deletion removes the
marker first, so a half-deleted checkpoint is never taken for a complete one.
The layout functions (:mod:`.layout`) and the checks (:mod:`.verify`) take the
filesystem made here; this module holds only what is specific to fsspec.

fsspec (and s3fs for ``s3://``) are in the optional ``data`` extra and are
imported only when a URL is used. Credentials and endpoints come from the
usual places: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL`` (an S3-compatible server), ``~/.aws``, an instance role;
or ``FSSPEC_S3_<OPTION>`` variables, which fsspec passes to s3fs.

Example::

    fs = filesystem("s3://bucket/run1")
    writer = dcp_writer("s3://bucket/run1/step_00000100")
    dcp.save(state, storage_writer=writer)
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ..errors import ConfigError
from ..extras import pip_install_hint


def is_url(path: str) -> bool:
    """Whether ``path`` names an fsspec location rather than a local directory.

    Example::

        is_url("s3://bucket/run1")   # True
        is_url("/ckpt/run1")         # False
    """
    return "://" in path


def local_path(path: str) -> str:
    """``file:///ckpt`` -> ``/ckpt`` (a local directory keeps the local code path); other paths unchanged."""
    return path[len("file://"):] if path.startswith("file://") else path


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None, what: str = "checkpoint_dir") -> Any:
    """The fsspec filesystem of ``url``; a :class:`ConfigError` in one line when fsspec
    (or the protocol's package, s3fs for ``s3://``) is not installed. ``what``: how the
    message names the value (the option or argument it came from).

    Example::

        fs = filesystem("s3://bucket/run1", {"endpoint_url": "http://127.0.0.1:9000"})
    """
    try:
        import fsspec  # the optional 'data' extra
    except ImportError:
        raise ConfigError(f"{what} {url} is a URL, which needs fsspec: {pip_install_hint('data')}") from None
    try:
        fs, _ = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as exc:  # fsspec's "Install s3fs to access S3"
        raise ConfigError(f"{what} {url}: {_first_line(exc)}: {_install_line(exc)}") from None
    except ValueError as exc:  # an unknown protocol
        raise ConfigError(f"{what} {url} is not a usable fsspec URL: {_first_line(exc)}") from None
    return fs


def _install_line(exc: ImportError) -> str:
    """The pip line for the package fsspec could not import: the ``data`` extra for the
    packages it ships (s3fs), else the package itself (gcsfs, adlfs: in no extra)."""
    missing = getattr(exc.__cause__, "name", None) or getattr(exc, "name", None)
    if not missing or missing.partition(".")[0] in _DATA_EXTRA_MODULES:
        return pip_install_hint("data")
    return f"pip install {missing.partition('.')[0]}"


_DATA_EXTRA_MODULES = ("fsspec", "s3fs", "aiobotocore", "botocore")
# A one-shot command's reads (``slipstream export``): an endpoint that refuses, or that accepts
# and never answers, is an error within seconds, not after s3fs's 5 tries of botocore's 5
# attempts with a 15 s read timeout (measured: 420 s against a socket that never answers).
_ONE_SHOT_S3 = {"connect_timeout": 5, "read_timeout": 10, "retries": {"total_max_attempts": 2, "mode": "standard"}}
_ONE_SHOT_S3FS_TRIES = 2
_S3_PROTOCOLS = ("s3", "s3a")


def one_shot_options(url: str, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """fsspec options for a command that reads once and exits (``slipstream export``): on
    ``s3://`` every request has at most 2 attempts of a 5 s connect and a 10 s read. Timeouts
    and retries given in ``storage_options["config_kwargs"]`` (or ``FSSPEC_S3_CONFIG_KWARGS``)
    take precedence, and so do ``AWS_MAX_ATTEMPTS``/``AWS_RETRY_MODE``. ``skip_instance_cache``:
    a filesystem of its own, not one fsspec cached earlier in this process, so the
    environment (credentials, ``AWS_ENDPOINT_URL``) is read now.

    Example::

        one_shot_options("s3://bucket/run1")["config_kwargs"]["read_timeout"]   # 10
    """
    options = {"skip_instance_cache": True, **dict(storage_options or {})}
    if url.partition("://")[0] in _S3_PROTOCOLS:
        try:
            from fsspec.config import conf
        except ImportError:  # filesystem() says what to install
            conf = {}
        given = options.get("config_kwargs", conf.get("s3", {}).get("config_kwargs", {}))
        bounds = {k: v for k, v in _ONE_SHOT_S3.items()
                  if k != "retries" or not {"AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"} & set(os.environ)}
        options["config_kwargs"] = {**bounds, **dict(given or {})}
    return options


def one_shot_filesystem(url: str, storage_options: Mapping[str, Any] | None = None,
                        what: str = "checkpoint_dir") -> Any:
    """:func:`filesystem` with :func:`one_shot_options`, whose calls s3fs tries twice (its
    default: 5 times, each of them the requests' attempts): an endpoint that refuses fails
    in about a second, one that accepts and never answers in under a minute.

    Example::

        fs = one_shot_filesystem("s3://bucket/run1", what="CHECKPOINT")
    """
    fs = filesystem(url, one_shot_options(url, storage_options), what)
    if url.partition("://")[0] in _S3_PROTOCOLS and isinstance(getattr(fs, "retries", None), int):
        fs.retries = min(fs.retries, _ONE_SHOT_S3FS_TRIES)
    return fs


_BUCKET_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss")


def missing_bucket(fs: Any, url: str) -> str | None:
    """The bucket of ``url`` when the store says it does not exist, else None (also for
    protocols without buckets).

    Example::

        missing_bucket(fs, "s3://no-such-bucket/run1")   # "no-such-bucket"
    """
    if url.partition("://")[0] not in _BUCKET_PROTOCOLS:
        return None
    bucket = url.partition("://")[2].partition("/")[0]
    try:
        fs.ls(bucket, detail=False)
    except FileNotFoundError:
        return bucket
    return None


def join(url: str, *names: str) -> str:
    """``join("s3://b/run", "step_00000100", "rank0.pt")`` -> ``"s3://b/run/step_00000100/rank0.pt"``."""
    return "/".join([url.rstrip("/"), *names])


def objects(fs: Any, url: str) -> dict[str, int]:
    """Every object under ``url`` as ``{path relative to url: bytes}``, from one fresh listing.

    Example::

        objects(fs, "s3://b/run/step_00000100")   # {".metadata": 2187, "__0_0.distcp": 3417, ...}
    """
    fs.invalidate_cache()  # another rank (another process) wrote here: never trust a cached listing
    base = fs._strip_protocol(url).rstrip("/")
    try:
        found = fs.find(url, detail=True)
    except FileNotFoundError:
        return {}
    out = {}
    for path, detail in found.items():
        path = fs._strip_protocol(path)
        if path.startswith(base + "/"):
            out[path[len(base) + 1:]] = int(detail.get("size") or 0)
    return out


def remove(fs: Any, url: str, first: str) -> None:
    """Delete every object under ``url``, the object ``first`` (the marker) before the others."""
    try:
        fs.rm_file(join(url, first))
    except FileNotFoundError:
        pass
    rest = objects(fs, url)
    if rest:
        fs.rm([join(url, rel) for rel in rest])
    fs.invalidate_cache()


def dcp_writer(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """DCP's fsspec writer for ``url``. No fsync: an object exists once its upload has
    completed (``sync_files=True`` would fall back to a machine-wide ``os.sync()`` per file)."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # torch does not re-export it

    return FsspecWriter(url, sync_files=False, **dict(storage_options or {}))


def dcp_reader(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """DCP's fsspec reader for ``url``."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(url, **dict(storage_options or {}))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
