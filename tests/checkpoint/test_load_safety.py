"""Checkpoint loading: plain data only, on the right device, with per-rank side groups
carrying the run's timeout, and CUDA RNG state of this rank's GPU only.

Everything runs on the CPU: GPU placement is checked through the storage
location tags torch writes, and CUDA RNG functions are faked.
"""

from __future__ import annotations

import datetime
import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from slipstream.checkpoint import layout, safe_load
from slipstream.checkpoint.manager import CheckpointManager
from slipstream.checkpoint.states import CallbackState, RNGState
from slipstream.errors import ConfigError
from slipstream.process import runtime


class Counter:
    def __init__(self, value=0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class RunsCode:
    """Unpickling this creates a file: stands for any code a crafted checkpoint could run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _manager(directory, **kw) -> CheckpointManager:
    # These tests rewrite files inside committed checkpoints: with verification on, the
    # changed sizes and checksums would be caught first (tests/checkpoint/test_verify.py).
    # Off, they reach the loader: what a tampered marker (matching sizes and checksums) would.
    kw.setdefault("verify", "off")
    return CheckpointManager(str(directory), handle_sigterm=False, **kw)


def _save(directory, per_rank: dict, shared: dict | None = None, step: int = 1) -> str:
    mgr = _manager(directory)
    for name, obj in (shared or {"model": nn.Linear(2, 2)}).items():
        mgr.register(name, obj)
    for name, obj in per_rank.items():
        mgr.register(name, obj, per_rank=True)
    mgr.save(step)
    return layout.step_dir(str(directory), step)


# --- 3. side groups carry the configured timeout -------------------------------------------


def test_checkpoint_groups_carry_the_run_timeout(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(runtime, "_RUNTIME", None)
    monkeypatch.setenv("SLIPSTREAM_COLLECTIVE_TIMEOUT_S", "17")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "new_group", lambda *a, **kw: calls.append(kw) or object())
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda *a, **kw: None)  # the lease's outcome
    _manager(tmp_path, async_save=True)
    assert [c.get("timeout") for c in calls] == [datetime.timedelta(seconds=17)] * 2
    assert all(c.get("backend") == "gloo" for c in calls)


# --- 4. plain data only, on the right device ---------------------------------------------------


def test_a_rank_file_holding_a_pickled_object_is_refused_not_run(tmp_path):
    path = _save(tmp_path, {"counter": Counter(3)})
    marker = tmp_path / "ran"
    torch.save({"counter": {"value": RunsCode(str(marker))}}, os.path.join(path, "rank0.pt"))
    reader = _manager(tmp_path)
    reader.register("model", nn.Linear(2, 2))
    reader.register("counter", Counter(), per_rank=True)
    with pytest.raises(safe_load.CheckpointRefused) as err:
        reader.restore_latest()
    assert not marker.exists(), "the checkpoint's pickle ran code"
    text = str(err.value)
    assert f"checkpoint file {os.path.join(path, 'rank0.pt')} holds pickled Python objects" in text
    assert "open" in text and "refused" in text  # names what it would have called
    assert isinstance(err.value, ConfigError) and err.value.exit_code == 2


def test_a_raw_pickle_or_garbage_is_refused_with_the_file_name(tmp_path):
    import pickle

    path = _save(tmp_path, {"counter": Counter(3)})
    rank_file = os.path.join(path, "rank0.pt")
    marker = tmp_path / "ran"
    with open(rank_file, "wb") as f:
        pickle.dump({"counter": RunsCode(str(marker))}, f)
    with pytest.raises(safe_load.CheckpointRefused, match=f"checkpoint file {rank_file} holds .*refused"):
        safe_load.load_rank_file(rank_file)
    assert not marker.exists()
    open(rank_file, "wb").close()
    with pytest.raises(safe_load.CheckpointRefused, match=f"checkpoint file {rank_file} cannot be read"):
        safe_load.load_rank_file(rank_file)
    with open(rank_file, "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(safe_load.CheckpointRefused, match=f"checkpoint file {rank_file} holds data that is not a plain"):
        safe_load.load_rank_file(rank_file)


def test_shared_state_with_a_pickled_object_is_refused_not_run(tmp_path):
    """DCP's non-tensor values: torch 2.13 unpickles them unrestricted; ours load weights_only."""
    marker = tmp_path / "ran"
    evil = CallbackState(lambda: {"note": RunsCode(str(marker))}, lambda s: None)
    _save(tmp_path, {}, shared={"model": nn.Linear(2, 2), "train": evil})
    reader = _manager(tmp_path)
    reader.register("model", nn.Linear(2, 2))
    reader.register("train", CallbackState(lambda: {"note": None}, lambda s: None))
    with pytest.raises(safe_load.CheckpointRefused, match="'train.note' holds a pickled Python object"):
        reader.restore_latest()
    assert not marker.exists(), "the checkpoint's pickle ran code"


def test_dcp_metadata_naming_other_code_is_refused(tmp_path):
    import pickle

    path = _save(tmp_path, {})
    marker = tmp_path / "ran"
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(RunsCode(str(marker)), f)
    reader = _manager(tmp_path)
    reader.register("model", nn.Linear(2, 2))
    with pytest.raises(safe_load.CheckpointRefused, match=r"\.metadata holds more than checkpoint metadata"):
        reader.restore_latest()
    assert not marker.exists()


def test_shared_plain_values_and_tensors_round_trip(tmp_path):
    """Counters, scaler and scheduler state, tuples, strings and None still load (weights_only)."""
    model = nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    values = {"step": 7, "scaler": {"scale": 1024.0, "_growth_tracker": 3}, "scheduler": sched.state_dict(),
              "pair": (1, 2.5), "name": "x", "none": None}
    from slipstream.checkpoint.states import ModelOptimizerState

    _save(tmp_path, {}, shared={"mo": ModelOptimizerState(model, opt), "train": CallbackState(lambda: values, None)})
    model2 = nn.Linear(3, 3)
    opt2 = torch.optim.Adam(model2.parameters())
    got = {}
    # DCP loads into the structure the registered object gives: same keys, placeholder values.
    shape = {**{k: None for k in values}, "scaler": {"scale": 0.0, "_growth_tracker": 0}, "scheduler": sched.state_dict()}
    reader = _manager(tmp_path)
    reader.register("mo", ModelOptimizerState(model2, opt2))
    reader.register("train", CallbackState(lambda: shape, got.update))
    assert reader.restore_latest() == 1
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert got["step"] == 7 and got["scaler"] == values["scaler"] and got["pair"] == (1, 2.5)
    assert got["name"] == "x" and got["none"] is None and got["scheduler"]["step_size"] == 2


def _draws():
    return (random.random(), float(np.random.rand()), float(np.random.randn()), torch.rand(3).tolist())


def test_rng_state_round_trips_bitwise_as_plain_data(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    path = _save(tmp_path, {"rng": RNGState()})
    expected = _draws()
    # The file is plain data: it loads with torch's strictest setting, no extra globals.
    torch.load(os.path.join(path, "rank0.pt"), weights_only=True)
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    reader = _manager(tmp_path)
    reader.register("model", nn.Linear(2, 2))
    reader.register("rng", RNGState(), per_rank=True)
    assert reader.restore_latest() == 1
    assert _draws() == expected


def test_rng_state_written_by_the_earlier_format_still_loads(tmp_path):
    """Before: numpy's get_state() tuple (an ndarray inside) and no weights_only. Still loads, bitwise."""
    path = _save(tmp_path, {"rng": RNGState()})
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    old = {"rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}
    torch.save(old, os.path.join(path, "rank0.pt"))
    expected = _draws()
    reader = _manager(tmp_path)
    reader.register("model", nn.Linear(2, 2))
    reader.register("rng", RNGState(), per_rank=True)
    reader.restore_latest()
    assert _draws() == expected


def test_gpu_tensors_come_back_on_this_ranks_device(tmp_path, monkeypatch):
    """A rank file written on cuda:3 (an error-feedback buffer) loads on a machine without that GPU:
    GPU storages go to this rank's device (the CPU here), CPU ones stay."""
    rank_file = str(tmp_path / "rank0.pt")
    real_tag = torch.serialization.location_tag
    residual = torch.arange(4.0)
    monkeypatch.setattr(torch.serialization, "location_tag",
                        lambda storage: "cuda:3" if storage.data_ptr() == residual.untyped_storage().data_ptr()
                        else real_tag(storage))
    torch.save({"sync": {"residuals": {"0": residual}}, "rng": {"torch": torch.get_rng_state()}}, rank_file)
    monkeypatch.setattr(torch.serialization, "location_tag", real_tag)
    with pytest.raises(RuntimeError):  # what a plain torch.load does here: tries cuda:3
        torch.load(rank_file, weights_only=True)
    state = safe_load.load_rank_file(rank_file, torch.device("cpu"))
    assert torch.equal(state["sync"]["residuals"]["0"], residual)
    # To a GPU: only the GPU storage is moved, to this rank's index.
    moved = []
    monkeypatch.setattr(torch.serialization, "default_restore_location",
                        lambda storage, location: moved.append(location) or storage)
    safe_load.load_rank_file(rank_file, torch.device("cuda", 1))
    assert moved == ["cuda:1"]


def test_manager_loads_gpu_saved_state_on_the_cpu(tmp_path, monkeypatch):
    path = _save(tmp_path, {"counter": Counter(1)})
    residual = torch.ones(3)
    real_tag = torch.serialization.location_tag
    monkeypatch.setattr(torch.serialization, "location_tag",
                        lambda storage: "cuda:2" if storage.data_ptr() == residual.untyped_storage().data_ptr()
                        else real_tag(storage))
    torch.save({"counter": {"value": residual}}, os.path.join(path, "rank0.pt"))
    monkeypatch.setattr(torch.serialization, "location_tag", real_tag)
    restored = Counter()
    reader = _manager(tmp_path)
    reader.register("model", nn.Linear(2, 2))
    reader.register("counter", restored, per_rank=True)
    reader.restore_latest()
    assert restored.value.device.type == "cpu" and torch.equal(restored.value, residual)


# --- 5. CUDA RNG state: this rank's GPU only -------------------------------------------------


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda as on a machine with ``count`` GPUs, this process on cuda:``current``."""
    log: dict = {"get": [], "set": []}

    def install(count: int, current: int):
        def get_state(device="cuda"):
            log["get"].append(device)
            return torch.full((8,), 10 + (current if device == "cuda" else int(device)), dtype=torch.uint8)

        def set_state(state, device="cuda"):
            index = current if device == "cuda" else int(torch.device("cuda", device).index
                                                          if isinstance(device, int) else device.index)
            if index >= count:
                raise IndexError(f"cuda:{index} does not exist on a machine with {count} GPU(s)")
            log["set"].append((int(state[0]), device))

        def get_all():
            return [get_state(i) for i in range(count)]

        monkeypatch.setattr(runtime, "_RUNTIME", None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", get_state)
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", get_all)
        monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
        monkeypatch.setattr(torch.cuda.random, "set_rng_state", set_state)  # what set_rng_state_all calls
        return log

    return install


def test_cuda_rng_saves_this_ranks_device_only(fake_cuda):
    log = fake_cuda(count=4, current=2)
    state = RNGState().state_dict()
    assert log["get"] == [2]
    assert isinstance(state["cuda"], torch.Tensor) and int(state["cuda"][0]) == 12


def test_cuda_rng_restores_on_a_machine_with_fewer_gpus(fake_cuda):
    fake_cuda(count=4, current=1)
    cpu_state = RNGState().state_dict()
    old = dict(cpu_state, cuda=[torch.full((8,), 10 + i, dtype=torch.uint8) for i in range(4)])  # earlier format
    log = fake_cuda(count=2, current=1)
    RNGState().load_state_dict(old)  # the old code set all 4 by index: cuda:2 does not exist here
    assert log["set"] == [(11, 1)]  # the entry of this rank's device, and only it
    new = RNGState().state_dict()
    log["set"].clear()
    RNGState().load_state_dict(new)
    assert log["set"] == [(11, "cuda")]


def test_cuda_rng_of_an_earlier_checkpoint_without_this_device_is_skipped(fake_cuda, caplog):
    fake_cuda(count=1, current=0)
    old = dict(RNGState().state_dict(), cuda=[torch.zeros(8, dtype=torch.uint8)])
    log = fake_cuda(count=4, current=3)
    with caplog.at_level("WARNING", logger="slipstream.checkpoint"):
        RNGState().load_state_dict(old)
    assert log["set"] == [] and "none for this rank's cuda:3" in caplog.text


def test_cuda_rng_in_a_checkpoint_is_skipped_without_gpus(fake_cuda, caplog):
    fake_cuda(count=2, current=0)
    saved = RNGState().state_dict()
    log = fake_cuda(count=0, current=0)
    with caplog.at_level("WARNING", logger="slipstream.checkpoint"):
        RNGState().load_state_dict(saved)
    assert log["set"] == [] and "no GPU is visible here" in caplog.text


def test_a_cpu_rank_on_a_gpu_machine_saves_no_cuda_state(fake_cuda, monkeypatch):
    log = fake_cuda(count=2, current=0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # gloo on the CPU never touched CUDA
    assert "cuda" not in RNGState().state_dict() and log["get"] == []


def test_dcp_metadata_with_enums_pickled_by_name_loads(tmp_path, monkeypatch):
    """CPython 3.11.0-3.11.4 (Debian 12's python3) pickle an enum member as getattr(EnumClass, "NAME"):
    a checkpoint written there must load (found by the container tests), and getattr stays limited
    to DCP's metadata enums."""
    import pathlib
    import pickle

    from torch.distributed.checkpoint import metadata as dcp_metadata

    from slipstream.checkpoint.states import ModelOptimizerState

    enum_cls = dcp_metadata._MEM_FORMAT_ENCODING
    monkeypatch.setattr(enum_cls, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self._name_)))
    model = nn.Linear(2, 2)
    path = _save(tmp_path, {}, shared={"mo": ModelOptimizerState(model, torch.optim.SGD(model.parameters(), 0.1))})
    assert b"getattr" in open(os.path.join(path, ".metadata"), "rb").read()
    safe_load.check_dcp_metadata(path)  # accepted: getattr(_MEM_FORMAT_ENCODING, 'TORCH_CONTIGUOUS_FORMAT')

    class Sneaky:
        def __reduce__(self):
            return getattr, (pathlib.PosixPath, "write_text")  # an allowed class, a method that writes

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Sneaky(), f)
    with pytest.raises(safe_load.CheckpointRefused, match="not a checkpoint metadata"):
        safe_load.check_dcp_metadata(path)


# --- 6. CUDA RNG state across machines (issue #42: the CPU suite takes the GPU's branches) ---


def _cuda_generator_state(seed: int, offset: int = 0) -> torch.Tensor:
    """What torch.cuda.get_rng_state() returns on a GPU: a CPU ByteTensor of 16 bytes, Philox's seed and
    offset (so read on an H200, torch 2.11)."""
    return torch.tensor(list(seed.to_bytes(8, "little") + offset.to_bytes(8, "little")), dtype=torch.uint8)


def _checkpoint_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "slipstream.checkpoint" and r.levelname == "WARNING"]


@pytest.mark.parametrize("entry", ["this-gpu", "every-gpu"], ids=["tensor", "earlier-list"])
def test_a_gpu_runs_checkpoint_resumes_on_a_machine_without_cuda(tmp_path, monkeypatch, caplog, entry):
    """The rank file a GPU run writes (its RNG entry holds "cuda") loads here through the manager:
    every other stream restored bitwise, the CUDA one skipped with one line, no traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a machine that has one
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = _save(tmp_path, {"rng": RNGState()})
    expected = _draws()
    rank_file = os.path.join(path, "rank0.pt")
    saved = torch.load(rank_file, weights_only=True)
    cuda = _cuda_generator_state(1234, 56)
    saved["rng"]["cuda"] = cuda if entry == "this-gpu" else [cuda, _cuda_generator_state(99)]
    torch.save(saved, rank_file)
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    reader = _manager(tmp_path)
    reader.register("model", nn.Linear(2, 2))
    reader.register("rng", RNGState(), per_rank=True)
    with caplog.at_level("WARNING", logger="slipstream.checkpoint"):
        assert reader.restore_latest() == 1
    assert _draws() == expected
    lines = _checkpoint_lines(caplog)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "CUDA RNG state" in lines[0] and "no GPU is visible here" in lines[0]


def test_a_cpu_checkpoint_resumed_on_a_gpu_says_the_cuda_generator_is_not_restored(fake_cuda, caplog):
    """The opposite: a checkpoint with no CUDA entry (written on CPUs) loaded by a process that draws on
    a GPU. The CUDA generator keeps its state: one line says so (GPU draws, dropout say, will not
    repeat the saving run's), rather than a silent difference."""
    fake_cuda(count=0, current=0)
    saved = RNGState().state_dict()
    assert "cuda" not in saved
    log = fake_cuda(count=1, current=0)
    with caplog.at_level("WARNING", logger="slipstream.checkpoint"):
        RNGState().load_state_dict(saved)
    assert log["set"] == []
    lines = _checkpoint_lines(caplog)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "no CUDA RNG state" in lines[0] and "not restored" in lines[0]


def test_a_cpu_rank_on_a_gpu_machine_loads_a_cpu_checkpoint_quietly(fake_cuda, monkeypatch, caplog):
    """gloo on the CPU of a GPU machine never touched CUDA: no CUDA stream to restore, nothing to say."""
    fake_cuda(count=0, current=0)
    saved = RNGState().state_dict()
    log = fake_cuda(count=2, current=0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with caplog.at_level("WARNING", logger="slipstream.checkpoint"):
        RNGState().load_state_dict(saved)
    assert log["set"] == [] and _checkpoint_lines(caplog) == []


def test_tensors_without_a_device_go_to_the_current_gpu_once_cuda_is_in_use(fake_cuda, monkeypatch):
    """load_rank_file without a device: this rank's GPU when CUDA is in use (before init() as well),
    the CPU when CUDA is only available (a CPU rank on a GPU machine)."""
    fake_cuda(count=4, current=2)
    assert safe_load.default_device() == torch.device("cuda", 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert safe_load.default_device() == torch.device("cpu")
