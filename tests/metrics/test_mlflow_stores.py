"""`--log-to mlflow` into each kind of MLflow store, as users run it.

A real 2-rank `slipstream run` logs into a real `mlflow server` (started here
on a free port, stopped at the end with every process it started); the run is
read back through MlflowClient and compared with rank 0's JSONL. A SQLite
database named by MLFLOW_TRACKING_URI is written and read back in-process. A store that cannot be
used (a file store MLflow refuses, a database without SQLAlchemy or its
driver, a scheme MLflow has no store for) is one line and exit 2. The default
store, RUN_DIR/mlflow.db: test_trackers.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

from slipstream.errors import EXIT_USAGE, ConfigError
from slipstream.extras import pip_install_hint
from slipstream.launch.proc import stop_processes
from slipstream.metrics.mlflow_store import check_store, mlflow_version, store_kind
from slipstream.metrics.trackers import MlflowSink, metric_values, require_trackers
from tests.conftest import need, need_module
from tests.harness import free_port

MLFLOW_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_ALLOW_FILE_STORE")

TRAIN = """\
import os

import torch
from torch import nn

import slipstream

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
run = slipstream.accelerate(model, opt)
x = torch.randn(16, 4) + int(os.environ["RANK"])  # the ranks' losses differ
for _ in range(6):
    run.backward(nn.functional.mse_loss(run.model(x), x.sum(1, keepdim=True)))
    run.step()
run.finish()
"""


def require_mlflow() -> None:
    for module in ("mlflow", "sqlalchemy", "alembic"):
        need_module(module, "pip install 'slipstream[mlflow]'")


@pytest.fixture()
def mlflow_env(monkeypatch):
    for name in MLFLOW_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in MLFLOW_VARIABLES}
    return {**env, "MLFLOW_DISABLE_TELEMETRY": "true", **extra}


def _group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


def _wait_until_it_answers(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with code {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"mlflow server did not answer at {url} within {timeout_s} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``http://127.0.0.1:PORT`` of a tracking server on a SQLite database (one worker,
    no job runner), as its users start it; its whole process group is stopped at the
    end, and checked gone."""
    require_mlflow()
    try:
        metadata.version("mlflow")
        full = True
    except metadata.PackageNotFoundError:
        full = False
    need(full, "`mlflow server` needs the mlflow package, not mlflow-skinny alone: "
               f"{pip_install_hint('mlflow-server')}")
    home = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = home / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{home}/server.db"],
            cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=_environment(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
    try:
        _wait_until_it_answers(url, proc, log_path, timeout_s=120)
        yield url
    finally:
        stop_processes([proc], grace_s=10, process_group=True)
    deadline = time.monotonic() + 10
    while _group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_members(proc.pid), "the MLflow server left processes behind"


def _slipstream_run(tmp_path: Path, run_dir: Path, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return subprocess.run(
        [sys.executable, "-m", "slipstream", "run", "-n", "2", "--run-dir", str(run_dir), "--log-to", "mlflow",
         "--log-every-steps", "2", "--grad-clip-norm", "1.0", "--no-progress", str(script)],
        cwd=tmp_path, env=_environment(**env), capture_output=True, text=True, timeout=300)


# --- a real 2-rank run into a server; a database the user names ----------------------------
@pytest.mark.distributed
def test_a_two_rank_run_logs_its_params_and_every_log_step_into_a_tracking_server(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "exp-a"
    proc = _slipstream_run(tmp_path, run_dir, MLFLOW_TRACKING_URI=mlflow_server)
    assert proc.returncode == 0, proc.stderr[-4000:]

    jsonl = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in jsonl] == [2, 4, 6]
    assert jsonl[-1]["loss"] > 0 and len(jsonl[-1]["busy_s_ranks"]) == 2  # a real 2-rank run's record
    ids = json.loads((run_dir / "metrics" / "trackers.json").read_text())["mlflow"]
    assert ids["tracking_uri"] == mlflow_server
    assert not (run_dir / "mlflow.db").exists()  # the server's store, not the default one
    client = MlflowClient(mlflow_server)
    run = client.get_run(ids["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "exp-a"
    assert run.data.params["world_size"] == "2" and run.data.params["grad_clip_norm"] == "1.0"
    assert run.data.params["log_to"] == "mlflow"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in jsonl]
    # Every figure of rank 0's last record, whole-job ones included, under its JSONL name.
    assert run.data.metrics == pytest.approx(metric_values(jsonl[-1]))


def test_a_sqlite_database_the_user_names(mlflow_env, monkeypatch, tmp_path):
    require_mlflow()
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/shared/mlflow.db"  # four slashes: an absolute path
    (tmp_path / "shared").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    sink = MlflowSink(str(tmp_path / "exp-b"), {"grad_clip_norm": 1.0, "world_size": 2})
    for step, loss in ((2, 0.75), (4, 0.5)):
        sink.write({"step": step, "rank": 0, "loss": loss, "data": {"wait_s": 0.125}})
    sink.close()
    client = MlflowClient(uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "exp-b"
    assert run.data.params == {"grad_clip_norm": "1.0", "world_size": "2"}
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "loss")] == [(2, 0.75), (4, 0.5)]
    assert run.data.metrics == {"loss": 0.5, "data/wait_s": 0.125}
    assert not (tmp_path / "exp-b" / "mlflow.db").exists()


# --- a store that cannot be used: one line, exit 2 ----------------------------------------
def test_a_refused_file_store_stops_the_run_before_training_with_one_line(mlflow_env, tmp_path):
    require_mlflow()
    need(mlflow_version() >= (3, 13), "needs MLflow 3.13 or newer (the first to refuse a file store)")
    uri = (tmp_path / "mlruns").as_uri()
    with pytest.raises(ConfigError) as info:
        check_store(uri, given=True)
    expected = str(info.value)
    assert "MLFLOW_ALLOW_FILE_STORE=true" in expected and "sqlite:////PATH/mlflow.db" in expected
    assert "http://HOST:PORT" in expected

    proc = _slipstream_run(tmp_path, tmp_path / "run", MLFLOW_TRACKING_URI=uri)
    assert proc.returncode == EXIT_USAGE == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert sum(expected in line for line in proc.stderr.splitlines()) == 1, proc.stderr  # once for both ranks
    assert not (tmp_path / "mlruns").exists() and not (tmp_path / "run" / "metrics" / "trackers.json").exists()
    assert (tmp_path / "run" / "metrics" / "rank0.jsonl").read_text() == ""  # not one step trained


@pytest.mark.parametrize("allow", [None, "true", "TRUE", "1", "false", "0"])
def test_the_file_store_check_agrees_with_mlflow(allow, mlflow_env, monkeypatch, tmp_path):
    require_mlflow()
    from mlflow.exceptions import MlflowException
    from mlflow.store.tracking.file_store import FileStore

    if allow is not None:
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", allow)
    uri = (tmp_path / "mlruns").as_uri()
    try:
        check_store(uri, given=True)
        ours = True
    except ConfigError:
        ours = False
    try:
        FileStore(uri)
        theirs = True
    except MlflowException:
        theirs = False
    assert ours == theirs
    assert store_kind(uri) == store_kind(str(tmp_path / "mlruns")) == "file"  # a bare path is a file store too


def test_a_value_mlflow_cannot_read_is_one_line(mlflow_env, monkeypatch, tmp_path):
    require_mlflow()
    need(mlflow_version() >= (3, 13), "needs MLflow 3.13 or newer (the first to read this variable)")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "yes")
    with pytest.raises(ConfigError, match="^log_to mlflow: MLFLOW_ALLOW_FILE_STORE=yes is none of true, false, 1, 0$"):
        check_store("file:/tmp/mlruns", given=True)
    from mlflow.store.tracking.file_store import FileStore

    with pytest.raises(ValueError):  # what MLflow itself does with it: a traceback from deep inside
        FileStore((tmp_path / "mlruns").as_uri())


def test_a_database_without_sqlalchemy_or_alembic_is_one_line_on_every_rank(mlflow_env, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "alembic", None)  # as if not installed
    with pytest.raises(ConfigError) as info:
        check_store("sqlite:////data/mlflow.db", given=True)
    assert str(info.value) == ("log_to mlflow: MLFLOW_TRACKING_URI=sqlite:////data/mlflow.db is a database, which "
                               f"MLflow reaches through alembic: {pip_install_hint('mlflow')}")
    assert info.value.exit_code == EXIT_USAGE
    # Unset, the store is RUN_DIR/mlflow.db; every rank checks it (require_trackers), not rank 0 alone.
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(ConfigError) as info:
        require_trackers(("mlflow",), str(tmp_path))
    default = f"sqlite:///{tmp_path}/mlflow.db"
    assert str(info.value) == (f"log_to mlflow: the default store {default} (MLFLOW_TRACKING_URI is unset) is a "
                               f"database, which MLflow reaches through sqlalchemy and alembic: "
                               f"{pip_install_hint('mlflow')}")
    for server in ("http://127.0.0.1:5000", "https://mlflow.example.com"):
        check_store(server, given=True)  # a server needs neither
    assert store_kind("postgresql+psycopg2://u@db/mlflow") == "database"
    assert store_kind("databricks") == store_kind("databricks://profile") == "other"


def test_a_missing_driver_or_an_unknown_scheme_is_one_line(mlflow_env, monkeypatch, tmp_path):
    require_mlflow()
    monkeypatch.setitem(sys.modules, "psycopg2", None)  # as if not installed
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql+psycopg2://u@127.0.0.1:1/mlflow")
    with pytest.raises(ConfigError, match="^log_to mlflow: the tracking URI postgresql\\+psycopg2://u@127.0.0.1:1/"
                                          "mlflow needs the Python module psycopg2, which is not installed "
                                          "\\(the database's driver\\)$"):
        MlflowSink(str(tmp_path), {"world_size": 1})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlit:///x.db")
    with pytest.raises(ConfigError) as info:
        MlflowSink(str(tmp_path), {"world_size": 1})
    assert str(info.value).startswith("log_to mlflow: MLflow has no tracking store for the URI sqlit:///x.db "
                                      "(its schemes here: ")
    assert "sqlite" in str(info.value) and "http" in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "metrics" / "trackers.json").exists()
