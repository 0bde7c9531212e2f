"""Experiment trackers (log_to=wandb, mlflow) and the user's own sinks, on one process.

Real libraries: W&B in offline mode (its run file is read back below), MLflow on
its default store here, the SQLite database RUN_DIR/mlflow.db (the other stores,
a tracking server among them: test_mlflow_stores.py). Outside CI a missing library skips its tests; with CI=true they fail.
"""

from __future__ import annotations

import glob
import json
import os
import re
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import slipstream
from slipstream.config import TrainConfig
from slipstream.errors import EXIT_USAGE, ConfigError
from slipstream.extras import pip_install_hint
from slipstream.metrics import StepRecorder
from slipstream.metrics.trackers import MlflowSink, WandbSink, metric_values, run_params
from tests.conftest import need_module


# What each tracker's tests import: MLflow's default store, a SQLite database, needs SQLAlchemy and alembic.
NEEDS = {"mlflow": ("mlflow", "sqlalchemy", "alembic")}


def require(extra: str) -> None:
    for module in NEEDS.get(extra, (extra,)):
        need_module(module, f"pip install 'slipstream[{extra}]'")


def _children() -> set[int]:
    """This process's live child processes (a zombie has exited: not counted)."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:  # a thread may end between the glob and the open (W&B's and torch's threads come and go)
            with open(path) as f:
                listed = f.read().split()
        except OSError:
            continue
        for pid in listed:
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    state = stat.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                pids.add(int(pid))
    return pids


@pytest.fixture()
def tracker_env(monkeypatch, tmp_path):
    """Offline, quiet W&B; no tracking server; and no W&B service process left behind."""
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_NAME", "WANDB_RESUME",
                 "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")  # no attempt to reach MLflow's servers
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's capture of stdout/stderr alone
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    before = _children()
    yield
    wandb = sys.modules.get("wandb")  # None: a test hid it
    if wandb is not None:
        wandb.teardown()  # stops the wandb-core service this process started
    deadline = time.monotonic() + 10  # teardown asks it to stop; it may take a moment to exit
    while not _children() <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _children() <= before, "a W&B service process outlived the test"


@pytest.fixture()
def single_process():
    slipstream.init()
    yield
    slipstream.shutdown()


# --- reading a W&B offline run back ----------------------------------------------------
def wandb_records(path: str):
    """The records of a ``run-<id>.wandb`` file: a 7-byte header (":W&B", magic,
    version), then LevelDB-log framing (32 KiB blocks; each chunk a 7-byte header
    crc32/length/type, type 1 = whole record, 2/3/4 = first/middle/last piece)
    around protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, pieces = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding (preallocated or end of block)
            pos += left
            continue
        pieces += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def wandb_run(run_dir: Path, attempt: int = 0) -> dict:
    """History rows by step, the config, the exit code, the name and id of an offline
    run under run_dir (a restart that continues the run writes a second directory)."""
    files = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    history, config, exit_code, name, run_id = {}, {}, None, None, None
    for record in wandb_records(files[attempt]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = row
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates})
            if kind == "run":
                name, run_id = record.run.display_name, record.run.run_id
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return {"history": history, "config": config, "exit_code": exit_code, "name": name, "id": run_id,
            "attempts": len(files)}


def mlflow_run(run_dir: Path):
    from mlflow.tracking import MlflowClient

    ids = json.loads((run_dir / "metrics" / "trackers.json").read_text())["mlflow"]
    assert ids["tracking_uri"] == "sqlite:///" + str(run_dir / "mlflow.db")
    client = MlflowClient(ids["tracking_uri"])
    return client, client.get_run(ids["run_id"])


class ListSink:
    def __init__(self):
        self.records, self.closed = [], False

    def write(self, record):
        self.records.append(dict(record))

    def close(self):
        self.closed = True


def _train(run_dir: Path, steps: int, sinks=(), **options) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    run = slipstream.accelerate(model, opt, run_dir=str(run_dir), progress=False, log_every_steps=2,
                                sinks=sinks, **options)
    x = torch.randn(16, 4)
    for _ in range(steps):
        run.backward(nn.functional.mse_loss(run.model(x), x.sum(1, keepdim=True)))
        run.step()
    run.finish()


# --- the tests -------------------------------------------------------------------------
def test_wandb_and_mlflow_receive_every_log_step(single_process, tracker_env, tmp_path):
    require("wandb")
    require("mlflow")
    run_dir = tmp_path / "exp-a"
    mine = ListSink()
    _train(run_dir, 6, sinks=[mine], log_to=("wandb", "mlflow"), precision="fp32", grad_clip_norm=1.0)

    # The user's sink: every log step's record, closed with the run.
    assert [r["step"] for r in mine.records] == [2, 4, 6] and mine.closed
    jsonl = [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in jsonl] == [r["loss"] for r in mine.records]

    wb = wandb_run(run_dir)
    assert wb["name"] == "exp-a" and wb["exit_code"] == 0 and wb["attempts"] == 1
    assert sorted(wb["history"]) == [2, 4, 6]
    for record in jsonl:
        row = wb["history"][record["step"]]
        assert row["loss"] == pytest.approx(record["loss"])
        assert row["step_time_s"] == pytest.approx(record["step_time_s"])
        assert "rank" not in row and "step" not in row
    assert wb["config"]["grad_clip_norm"] == 1.0 and wb["config"]["world_size"] == 1
    assert "precision" not in wb["config"]  # fp32 is the default: only changed fields are params

    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == "exp-a"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"])) for r in jsonl]
    assert run.data.params["grad_clip_norm"] == "1.0" and run.data.params["world_size"] == "1"
    assert set(run.data.metrics) == set(metric_values(jsonl[-1]))

    # A restart in the same run directory continues the same tracker runs. (W&B
    # names an offline run's directory by the second it started: keep the first
    # attempt's apart should this test be that fast.)
    first = Path(glob.glob(str(run_dir / "wandb" / "offline-run-*"))[0])
    first.rename(first.with_name("offline-run-00000000_000000-" + wb["id"]))
    _train(run_dir, 2, log_to=("wandb", "mlflow"))
    client, again = mlflow_run(run_dir)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2, 4, 6, 2]
    resumed = wandb_run(run_dir, attempt=1)
    assert resumed["attempts"] == 2 and resumed["id"] == wb["id"] and resumed["exit_code"] == 0


def test_a_run_closed_by_an_exception_is_marked_failed(tracker_env, tmp_path):
    require("wandb")
    require("mlflow")
    sinks = [WandbSink(str(tmp_path), {"world_size": 1}), MlflowSink(str(tmp_path), {"world_size": 1})]
    for sink in sinks:
        sink.write({"step": 1, "rank": 0, "loss": 0.5, "data": {"wait_s": 0.25}, "note": "x", "ranks": [1.0]})
    try:
        raise RuntimeError("loss is nan")
    except RuntimeError:
        for sink in sinks:
            sink.close()  # finish() in the user's finally/except: the error propagates
    wb = wandb_run(tmp_path)
    assert wb["exit_code"] == 1 and wb["history"][1] == {"loss": 0.5, "data/wait_s": 0.25,
                                                          **{k: v for k, v in wb["history"][1].items()
                                                             if k.startswith("_")}}
    client, run = mlflow_run(tmp_path)
    assert run.info.status == "FAILED"
    assert set(run.data.metrics) == {"loss", "data/wait_s"}


def test_a_run_left_open_at_exit_is_failed_when_the_process_dies_of_an_exception(tracker_env, tmp_path,
                                                                                  monkeypatch):
    require("mlflow")
    sink = MlflowSink(str(tmp_path), {"world_size": 1})
    sink.write({"step": 3, "loss": 1.0})
    # No finish(): what the interpreter does at exit after an uncaught exception
    # (sys.last_value set, then the atexit hooks; the sink registered one).
    monkeypatch.setattr(sys, "last_value", RuntimeError("boom"), raising=False)
    sink._close_at_exit()
    client, run = mlflow_run(tmp_path)
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [3]


def test_a_missing_tracker_package_is_one_config_error(single_process, tracker_env, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError) as info:
        slipstream.accelerate(model, opt, run_dir=str(tmp_path), progress=False, log_to="wandb")
    assert str(info.value) == f"log_to wandb needs the wandb package: {pip_install_hint('wandb')}"
    assert "pip install 'slipstream[wandb]' 'torch==" in str(info.value)  # the installed torch stays
    assert info.value.exit_code == EXIT_USAGE == 2
    monkeypatch.setitem(sys.modules, "mlflow", None)
    expected = re.escape(f"log_to mlflow needs the mlflow package: {pip_install_hint('mlflow')}")
    with pytest.raises(ConfigError, match=expected):
        StepRecorder(rank=3, world_size=4, run_dir=str(tmp_path), progress=False).attach(
            model, TrainConfig(log_to=("mlflow",)))  # every rank checks, not rank 0 alone


def test_only_rank_0_opens_a_tracker_run(tracker_env, tmp_path):
    require("wandb")
    require("mlflow")
    require("tensorboard")
    model = nn.Linear(2, 1)
    rec = StepRecorder(rank=1, world_size=2, run_dir=str(tmp_path), progress=False)
    rec.attach(model, TrainConfig(log_to=("wandb", "mlflow", "tensorboard")))
    kinds = {type(s).__name__ for s in rec.sinks}
    rec.close()
    assert kinds == {"JsonlSink", "TensorBoardSink"}  # tensorboard in log_to = tensorboard=True, per rank
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "metrics" / "trackers.json").exists()


def test_metric_names_and_params():
    assert metric_values({"step": 4, "rank": 0, "time_s": 1.5, "loss": None, "ok": True, "sync_bytes_sent": 10,
                          "busy_s_ranks": [1.0, 2.0], "straggler_message": "x", "data": {"wait_s": 0.1}}) == {
        "time_s": 1.5, "sync_bytes_sent": 10, "data/wait_s": 0.1}
    params = run_params(TrainConfig(precision="bf16", log_to=("mlflow",)), world_size=8)
    assert params == {"precision": "bf16", "log_to": ["mlflow"], "world_size": 8}
