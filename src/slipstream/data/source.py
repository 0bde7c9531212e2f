"""Where a dataset lives: a local directory or any fsspec URL (s3://, gs://, ...).

Local directories are read in place through memory maps; anything else goes
through the node cache (``cache.py``), because a memory map needs a local file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Mapping

from ..errors import ConfigError, SlipstreamError, UsageError
from ..extras import pip_install_hint


class SourceUnavailable(SlipstreamError, OSError):
    """The store holding a dataset could not be read (network, endpoint, credentials).

    Store clients raise their own types (botocore's EndpointConnectionError is
    not an OSError); they are turned into this one, with the URL in the message.
    """


def _store_call(what: str, fn, *args):
    try:
        return fn(*args)
    except (FileNotFoundError, SlipstreamError):
        raise
    except Exception as exc:  # noqa: BLE001 - any client error: network, auth, throttling
        raise SourceUnavailable(f"cannot read {what}: {type(exc).__name__}: {exc}") from exc


def _split_protocol(url: str) -> tuple[str, str]:
    if "://" in url:
        proto, rest = url.split("://", 1)
        return proto.lower(), rest
    return "file", url


class Source:
    """A dataset root. ``join(name)`` is what errors print; ``fs`` the fsspec filesystem.

    Example::

        src = Source("s3://bucket/tokens", {"endpoint_url": "http://127.0.0.1:9000"})
        index_bytes = src.read_bytes("index.json")
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None):
        self.url = str(url).rstrip("/") or "/"
        self.storage_options = dict(storage_options or {})
        proto, rest = _split_protocol(self.url)
        self.is_local = proto in ("file", "local")
        if self.is_local:
            self.root = os.path.abspath(os.path.expanduser(rest))
            self._fs = None
            self._fs_pid = -1
        else:
            self.root = None
            self._fs_pid = -1
            self._fs = None  # built lazily: fsspec filesystems do not survive pickling everywhere

    # fsspec filesystem objects are cached by fsspec per (class, options) and are
    # fork-aware; we rebuild ours after unpickling in a data-loader worker.
    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_fs"] = None
        return d

    @property
    def fs(self):
        # A filesystem made before a fork (e.g. in the parent of data-loader
        # workers) holds the parent's event loop: rebuild it in the child.
        if self._fs is None or self._fs_pid != os.getpid():
            try:
                import fsspec
            except ImportError:  # pragma: no cover - fsspec is a declared extra
                raise UsageError(f"reading from a URL needs fsspec: {pip_install_hint('data')}") from None
            try:
                self._fs, self._path = fsspec.core.url_to_fs(self.url, **self.storage_options)
                self._fs_pid = os.getpid()
            except (ImportError, ValueError) as exc:
                raise UsageError(f"cannot open {self.url}: {exc}") from None
        return self._fs

    def _remote(self, name: str) -> str:
        self.fs  # noqa: B018 - sets _path
        return f"{self._path.rstrip('/')}/{name}"

    def join(self, name: str) -> str:
        if self.is_local:
            return os.path.join(self.root, name)
        return f"{self.url}/{name}"

    def local_path(self, name: str) -> str:
        assert self.is_local
        return os.path.join(self.root, name)

    # -- reading
    def exists(self, name: str) -> bool:
        if self.is_local:
            return os.path.exists(self.local_path(name))
        return bool(_store_call(self.join(name), self.fs.exists, self._remote(name)))

    def read_bytes(self, name: str) -> bytes:
        try:
            if self.is_local:
                with open(self.local_path(name), "rb") as f:
                    return f.read()
            return _store_call(self.join(name), self.fs.cat_file, self._remote(name))
        except FileNotFoundError:
            raise ConfigError(f"{self.join(name)} does not exist (is this a packed dataset? see `slipstream data pack`)") from None

    def get_file(self, name: str, local_path: str) -> None:
        """Download one object to a local file (one streaming GET for object stores)."""
        if self.is_local:
            shutil.copyfile(self.local_path(name), local_path)
        else:
            _store_call(self.join(name), self.fs.get_file, self._remote(name), local_path)

    # -- writing (used by ShardWriter)
    def staging_dir(self) -> str:
        if self.is_local:
            os.makedirs(self.root, exist_ok=True)
            return self.root
        return tempfile.mkdtemp(prefix="slipstream-pack-")

    def cleanup_staging(self, staging: str) -> None:
        if not self.is_local:
            shutil.rmtree(staging, ignore_errors=True)

    def upload(self, local_file: str, name: str) -> None:
        if self.is_local:
            dest = self.local_path(name)
            if os.path.abspath(local_file) != dest:
                os.replace(local_file, dest)
            return
        _store_call(self.join(name), self.fs.put_file, local_file, self._remote(name))
        os.remove(local_file)

    def put_bytes(self, name: str, data: bytes) -> None:
        """Publish a small object; atomic for local directories (write + rename)."""
        if self.is_local:
            dest = self.local_path(name)
            tmp = f"{dest}.tmp.{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, dest)
            return
        _store_call(self.join(name), self.fs.pipe_file, self._remote(name), data)

    def __repr__(self) -> str:
        return f"Source({self.url!r})"
