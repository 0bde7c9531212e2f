"""The MLflow store a run logs to, and what that store needs before MLflow is asked.

``MLFLOW_TRACKING_URI`` names the store; unset, it is the SQLite database
``RUN_DIR/mlflow.db`` (MLflow 3's own default is ``sqlite:///mlflow.db`` in the
working directory; in the run directory it stays with the run's other records).
The three kinds, and what each needs beyond mlflow-skinny:

- a database (``sqlite:``, ``postgresql:``, ``mysql:``, ``mssql:``): SQLAlchemy
  and alembic, in the ``mlflow`` extra (a server database also needs its driver);
- a tracking server (``http://``, ``https://``): nothing more;
- a file store (``file:`` or a bare path): MLflow 3.13 and newer refuse it unless
  ``MLFLOW_ALLOW_FILE_STORE=true``.

:func:`check_store` says so in one line (a ConfigError, exit 2) on every rank
before training, where MLflow would fail later, on rank 0 only, misleadingly or
with a traceback: without SQLAlchemy, ``MlflowClient("sqlite:...")`` says "Model
registry functionality is unavailable" (MLflow registers ``sqlite:`` only when
SQLAlchemy imports, and its tracking-store registry raises the model registry's
exception for a scheme it lacks; nothing here touches the model registry);
without alembic it is a ModuleNotFoundError from inside MLflow.

Example::

    uri, given = tracking_uri("runs/a")   # ("sqlite:////abs/runs/a/mlflow.db", False) when the variable is unset
    check_store(uri, given)               # ConfigError when sqlalchemy or alembic is missing
"""

from __future__ import annotations

import importlib.util
import os
import re
from importlib import metadata
from urllib.parse import urlparse

from ..errors import ConfigError
from ..extras import pip_install_hint

# The schemes of MLflow's SQLAlchemy store (mlflow.store.db.db_types), "+driver" forms included.
DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
_FILE_STORE_REFUSED_FROM = (3, 13)  # MLflow 3.13 turned the file store's warning into an error
_WHOLE_URI_SCHEMES = ("databricks", "databricks-uc", "uc")  # MLflow reads these bare words as schemes
_BOOLEAN = ("true", "false", "1", "0")  # what MLflow accepts in MLFLOW_ALLOW_FILE_STORE


def tracking_uri(run_dir: str) -> tuple[str, bool]:
    """``(uri, given)``: ``MLFLOW_TRACKING_URI``, or the database ``RUN_DIR/mlflow.db``.

    Example::

        tracking_uri("runs/a")   # ("sqlite:////home/me/runs/a/mlflow.db", False)
    """
    given = os.environ.get("MLFLOW_TRACKING_URI")
    if given:
        return given, True
    return "sqlite:///" + os.path.abspath(os.path.join(run_dir, "mlflow.db")), False


def store_kind(uri: str) -> str:
    """``"database"``, ``"file"``, ``"server"`` or ``"other"`` (Databricks, a plugin's scheme).

    Example::

        store_kind("postgresql+psycopg2://u@db/mlflow")   # "database"
    """
    if uri in _WHOLE_URI_SCHEMES:
        return "other"
    scheme = urlparse(uri).scheme.lower().split("+", 1)[0]
    if scheme in DATABASES:
        return "database"
    if scheme in ("", "file"):
        return "file"
    return "server" if scheme in ("http", "https") else "other"


def check_store(uri: str, given: bool) -> None:
    """Raise a ConfigError when the store ``uri`` names cannot be used here.

    Example::

        check_store("file:/tmp/mlruns", True)   # ConfigError: ... refuses unless MLFLOW_ALLOW_FILE_STORE=true ...
    """
    where = f"MLFLOW_TRACKING_URI={uri}" if given else f"the default store {uri} (MLFLOW_TRACKING_URI is unset)"
    kind = store_kind(uri)
    if kind == "database":
        missing = [m for m in ("sqlalchemy", "alembic") if importlib.util.find_spec(m) is None]
        if missing:
            raise ConfigError(f"log_to mlflow: {where} is a database, which MLflow reaches through "
                              f"{' and '.join(missing)}: {pip_install_hint('mlflow')}")
    elif kind == "file":
        version = mlflow_version()
        if version < _FILE_STORE_REFUSED_FROM:
            return
        allow = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
        if allow is not None and allow.lower() not in _BOOLEAN:
            raise ConfigError(f"log_to mlflow: MLFLOW_ALLOW_FILE_STORE={allow} is none of true, false, 1, 0")
        if allow is not None and allow.lower() in ("true", "1"):
            return
        raise ConfigError(f"log_to mlflow: {where} is a file store, which MLflow {'.'.join(map(str, version))} "
                          f"refuses unless MLFLOW_ALLOW_FILE_STORE=true; or log to a database "
                          f"(MLFLOW_TRACKING_URI=sqlite:////PATH/mlflow.db, or unset for RUN_DIR/mlflow.db) "
                          f"or to a tracking server (MLFLOW_TRACKING_URI=http://HOST:PORT)")


def mlflow_version() -> tuple[int, ...]:
    """The installed MLflow's (major, minor), read from its package metadata (no import);
    mlflow-skinny and mlflow carry the same one; (0, 0) when neither is installed.

    Example::

        mlflow_version() >= (3, 13)   # True: this MLflow refuses a file store unless told otherwise
    """
    for dist in ("mlflow-skinny", "mlflow"):
        try:
            found = re.match(r"(\d+)\.(\d+)", metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
        if found:
            return int(found.group(1)), int(found.group(2))
    return (0, 0)


__all__ = ["DATABASES", "check_store", "mlflow_version", "store_kind", "tracking_uri"]
