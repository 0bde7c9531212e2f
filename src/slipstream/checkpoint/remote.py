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


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec filesystem of ``url``; a :class:`ConfigError` in one line when fsspec
    (or the protocol's package, s3fs for ``s3://``) is not installed.

    Example::

        fs = filesystem("s3://bucket/run1", {"endpoint_url": "http://127.0.0.1:9000"})
    """
    try:
        import fsspec  # the optional 'data' extra
    except ImportError:
        raise ConfigError(f"checkpoint_dir {url} is a URL, which needs fsspec: {pip_install_hint('data')}") from None
    try:
        fs, _ = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as exc:  # fsspec's "Install s3fs to access S3"
        raise ConfigError(f"checkpoint_dir {url}: {_first_line(exc)}: {pip_install_hint('data')}") from None
    except ValueError as exc:  # an unknown protocol
        raise ConfigError(f"checkpoint_dir {url} is not a usable fsspec URL: {_first_line(exc)}") from None
    return fs


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
