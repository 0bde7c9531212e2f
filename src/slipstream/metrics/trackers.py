"""Experiment trackers as sinks: Weights & Biases and MLflow.

``log_to=("wandb", "mlflow")`` (``--log-to``, ``SLIPSTREAM_LOG_TO``) makes the
recorder open one tracker run per training run, on rank 0 only: rank 0's record
at a log step already holds the whole job's figures (throughput of every rank,
the straggler verdict), so other ranks would only repeat it. Each record goes
out as one call (``run.log`` / ``log_batch``) with the optimizer step as the
step and the JSONL field names as metric names (nested keys joined with "/").
The run's parameters are the config fields that differ from the defaults plus
the world size, logged once.

The tracker run id is kept in ``RUN_DIR/metrics/trackers.json``, so a restart
(``slipstream run --max-restarts``) or a resume in the same run directory
continues the same tracker run. The run is closed by ``run.finish()``; when it
is closed while an exception propagates, or the process dies of an uncaught one
before ``finish()``, it is marked failed (W&B exit code 1, MLflow ``FAILED``;
``KILLED`` after Ctrl-C).

Example::

    sinks = open_trackers(("mlflow",), "runs/a", {"precision": "bf16", "world_size": 8})
    for sink in sinks:
        sink.write({"step": 10, "loss": 2.3}); sink.close()
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ..config import TrainConfig
from ..errors import ConfigError
from ..extras import pip_install_hint
from .mlflow_store import check_store, tracking_uri
from .sinks import Sink

log = logging.getLogger(__name__)

# tracker name -> the module it imports (its pip extra is slipstream[<tracker name>])
MODULES = {"wandb": "wandb", "mlflow": "mlflow"}

_NOT_METRICS = frozenset({"step", "rank"})
_MLFLOW_BATCH = 100  # MLflow's limit of params per log_batch call
_MLFLOW_PARAM_CHARS = 6000  # and of a param value's length


def require_trackers(names: Sequence[str], run_dir: str = ".") -> None:
    """Raise one ConfigError (exit 2) when a tracker in ``names`` is not installed, or
    MLflow's store (``MLFLOW_TRACKING_URI``, default ``RUN_DIR/mlflow.db``) needs
    what is not (mlflow_store.check_store).

    Every rank checks, so all of them stop before training rather than rank 0 alone.

    Example::

        require_trackers(("wandb",))   # ConfigError: log_to wandb needs the wandb package: ...
    """
    for name in names:
        module = MODULES.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"log_to {name} needs the {module} package: {pip_install_hint(name)}")
        if name == "mlflow":
            check_store(*tracking_uri(run_dir))


def metric_values(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numeric fields of a record, nested keys joined with "/" (strings, lists,
    None and booleans are not metrics; ``step`` and ``rank`` are the axes).

    Example::

        metric_values({"step": 3, "loss": 1.5, "data": {"wait_s": 0.1}, "msg": "x"})
        # {"loss": 1.5, "data/wait_s": 0.1}
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key in _NOT_METRICS:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(metric_values(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out


def run_params(config: TrainConfig, world_size: int) -> dict[str, Any]:
    """What a tracker run is labelled with: the config fields (flat names) that
    differ from the defaults, and the world size.

    Example::

        run_params(TrainConfig(precision="bf16"), 8)   # {"precision": "bf16", "world_size": 8}
    """
    defaults = TrainConfig().flat()
    params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in config.flat().items() if v != defaults[k]}
    params["world_size"] = world_size
    return params


def _propagating() -> BaseException | None:
    """The exception propagating through the caller (``finish()`` in a ``finally``), if any."""
    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return None
    return exc


class _TrackerIds:
    """``RUN_DIR/metrics/trackers.json``: each tracker's run id in this run directory."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, "metrics", "trackers.json")

    def get(self, tracker: str) -> dict[str, Any]:
        try:
            with open(self.path, encoding="utf-8") as f:
                return dict(json.load(f).get(tracker) or {})
        except (OSError, ValueError):
            return {}

    def put(self, tracker: str, ids: dict[str, Any]) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
        data[tracker] = ids
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)


class _ClosedAtExit:
    """A tracker run that is ended once: by ``close()`` (failed when an exception is
    propagating through it), or at interpreter exit when ``close()`` never came
    (failed when the process dies of an uncaught exception). atexit hooks run last
    registered first, so this runs before the library's own exit handling."""

    _ended = False

    def _arm(self) -> None:
        atexit.register(self._close_at_exit)

    def close(self) -> None:
        self._end(_propagating())

    def _close_at_exit(self) -> None:
        # The interpreter sets sys.last_value for an uncaught exception before atexit.
        self._end(getattr(sys, "last_value", None))

    def _end(self, failure: BaseException | None) -> None:
        if self._ended:
            return
        self._ended = True
        atexit.unregister(self._close_at_exit)
        self._finish(failure)

    def _finish(self, failure: BaseException | None) -> None:
        raise NotImplementedError


class WandbSink(_ClosedAtExit):
    """One Weights & Biases run. Project: ``WANDB_PROJECT`` (default "slipstream");
    name: ``WANDB_NAME`` or the run directory's name; id: ``WANDB_RUN_ID``, or the
    one this run directory had, or a new one; files under ``WANDB_DIR`` or the run
    directory; ``WANDB_MODE`` (``offline`` needs no server), ``WANDB_ENTITY``,
    ``WANDB_API_KEY`` as wandb reads them.

    Example::

        sink = WandbSink("runs/a", {"world_size": 2}); sink.write({"step": 10, "loss": 2.3}); sink.close()
    """

    def __init__(self, run_dir: str, params: Mapping[str, Any]) -> None:
        import wandb

        ids = _TrackerIds(run_dir)
        project = os.environ.get("WANDB_PROJECT") or "slipstream"
        known = ids.get("wandb")
        run_id = (os.environ.get("WANDB_RUN_ID") or (known.get("id") if known.get("project") == project else None)
                  or uuid.uuid4().hex[:12])
        try:
            self.run = wandb.init(
                project=project,
                name=os.environ.get("WANDB_NAME") or os.path.basename(os.path.abspath(run_dir)),
                dir=os.environ.get("WANDB_DIR") or run_dir,
                id=run_id,
                resume="allow",  # a restart in this run directory continues the run
                reinit="create_new",  # leave any run of the user's own open
                config=dict(params),
            )
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as exc:
            raise ConfigError(f"log_to wandb: {exc} (log in with `wandb login` or WANDB_API_KEY, "
                              f"or set WANDB_MODE=offline)") from exc
        ids.put("wandb", {"id": run_id, "project": project})
        self._arm()

    def write(self, record: dict[str, Any]) -> None:
        # One call per log step; wandb hands it to its service process and returns.
        self.run.log(metric_values(record), step=int(record["step"]), commit=True)

    def _finish(self, failure: BaseException | None) -> None:
        self.run.finish(exit_code=0 if failure is None else 1)


class MlflowSink(_ClosedAtExit):
    """One MLflow run. Tracking URI: ``MLFLOW_TRACKING_URI`` (default: the SQLite
    database ``RUN_DIR/mlflow.db``; mlflow_store says what each kind of store
    needs); experiment: ``MLFLOW_EXPERIMENT_NAME`` (default "slipstream"); run
    name: the run directory's name; ``MLFLOW_RUN_ID``: log into that existing run
    (as a restart does into its own). Metrics are sent with
    ``log_batch(synchronous=False)``: MLflow's queue thread writes them, and
    ``close()`` waits for the last batch.

    Example::

        sink = MlflowSink("runs/a", {"world_size": 2}); sink.write({"step": 10, "loss": 2.3}); sink.close()
    """

    def __init__(self, run_dir: str, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        uri, uri_given = tracking_uri(run_dir)
        check_store(uri, uri_given)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "slipstream"
        ids = _TrackerIds(run_dir)
        known = ids.get("mlflow")
        try:
            self.client = _client(MlflowClient, uri)
            given = os.environ.get("MLFLOW_RUN_ID")
            if given or (known.get("tracking_uri") == uri and known.get("experiment") == experiment):
                self.run_id = given or known["run_id"]
                self.client.update_run(self.run_id, status="RUNNING")  # continued (after a restart)
            else:
                found = self.client.get_experiment_by_name(experiment)
                experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
                run = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(run_dir)))
                self.run_id = run.info.run_id
                items = [Param(k, _param_text(v)) for k, v in params.items()]
                for i in range(0, len(items), _MLFLOW_BATCH):
                    self.client.log_batch(self.run_id, params=items[i:i + _MLFLOW_BATCH])
        except MlflowException as exc:
            raise ConfigError(f"log_to mlflow: tracking URI {uri}: {exc.message}") from exc
        ids.put("mlflow", {"run_id": self.run_id, "tracking_uri": uri, "experiment": experiment})
        self._pending: Any = None  # the last batch queued (mlflow's RunOperations)
        self._failures = 0
        self._arm()

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step = int(record["step"])
        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now_ms, step) for k, v in metric_values(record).items()]
        if metrics:
            # The previous log step's batch is written by now (a wait of ~0): waiting
            # for it keeps at most one in flight, so batches land in order.
            self._wait_pending()
            # Queued: one batch per log step, written by MLflow's logging thread.
            self._pending = self.client.log_batch(self.run_id, metrics=metrics, synchronous=False)

    def _wait_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except Exception as exc:  # noqa: BLE001 - a tracker outage must not stop training; the JSONL has it all
            self._failures += 1
            if self._failures == 1:
                log.warning(f"[slipstream] MLflow: a metrics batch was not logged ({exc}); training goes on, "
                            f"RUN_DIR/metrics/rank0.jsonl has every record")

    def _finish(self, failure: BaseException | None) -> None:
        self._wait_pending()
        status = ("FINISHED" if failure is None else "KILLED" if isinstance(failure, KeyboardInterrupt)
                  else "FAILED")
        self.client.set_terminated(self.run_id, status=status)


def _param_text(value: Any) -> str:
    """A param as MLflow stores it: text, at most 6000 characters (its limit)."""
    if isinstance(value, (list, tuple)):
        text = ",".join(str(v) for v in value)
    elif isinstance(value, dict):
        text = json.dumps(value, sort_keys=True)
    else:
        text = str(value)
    return text[:_MLFLOW_PARAM_CHARS]


def _client(client_class: Any, uri: str) -> Any:
    """``MlflowClient(uri)``, which builds the store at once: a scheme MLflow has no
    store for, or a database driver that is not installed, is one line here."""
    from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException

    try:
        return client_class(tracking_uri=uri)
    except UnsupportedModelRegistryStoreURIException as exc:  # the tracking stores' registry raises it too
        schemes = ", ".join(s for s in exc.supported_uri_schemes if s)
        raise ConfigError(f"log_to mlflow: MLflow has no tracking store for the URI {uri} "
                          f"(its schemes here: {schemes})") from exc
    except ImportError as exc:  # SQLAlchemy imports a database's driver when it builds the engine
        raise ConfigError(f"log_to mlflow: the tracking URI {uri} needs the Python module {exc.name}, "
                          f"which is not installed (the database's driver)") from exc


def open_trackers(names: Sequence[str], run_dir: str, params: Mapping[str, Any]) -> list[Sink]:
    """A sink per tracker in ``names`` (``tensorboard`` is not one here: the recorder
    opens it per rank); call on rank 0 only.

    Example::

        open_trackers(("wandb", "mlflow"), "runs/a", run_params(config, world_size=8))
    """
    require_trackers(names, run_dir)
    sinks: list[Sink] = []
    try:
        for name in names:
            if name == "wandb":
                sinks.append(WandbSink(run_dir, params))
            elif name == "mlflow":
                sinks.append(MlflowSink(run_dir, params))
    except BaseException:
        for sink in sinks:  # the ones already open
            sink.close()
        raise
    return sinks


__all__ = ["MODULES", "MlflowSink", "WandbSink", "metric_values", "open_trackers", "require_trackers", "run_params"]
