"""Which device and backend a rank gets (runtime.choose_device / choose_backend / init),
checked with fake GPU counts: no GPU is needed to test the logic."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from slipstream.errors import ConfigError
from slipstream.process import gloo_interface, runtime


def test_nccl_gives_each_local_rank_its_own_gpu():
    assert runtime.choose_device("nccl", None, 0, 2, 2) == torch.device("cuda", 0)
    assert runtime.choose_device("nccl", "cuda", 1, 2, 4) == torch.device("cuda", 1)


@pytest.mark.parametrize("local_rank,local_world,count", [(2, 4, 2), (0, 4, 2), (3, 4, 3)])
def test_nccl_refuses_fewer_gpus_than_ranks(local_rank, local_world, count):
    # Every rank of the node refuses (rank 0 too), so none waits for a peer that failed.
    with pytest.raises(ConfigError) as err:
        runtime.choose_device("nccl", None, local_rank, local_world, count, visible="0,1")
    text = str(err.value)
    assert f"local rank {local_rank} of {local_world} on this node but only {count} GPU(s) visible" in text
    assert "(CUDA_VISIBLE_DEVICES=0,1)" in text
    assert f"--nproc-per-node {count}" in text and "backend='gloo'" in text


def test_unset_cuda_visible_devices_is_named():
    with pytest.raises(ConfigError, match=r"CUDA_VISIBLE_DEVICES=unset"):
        runtime.choose_device("nccl", None, 3, 4, 2, visible=None)


def test_gloo_with_cuda_shares_gpus_on_purpose():
    # Two ranks on one H200 with gloo: the GPU acceptance run.
    assert [runtime.choose_device("gloo", "cuda", r, 2, 1) for r in (0, 1)] == [torch.device("cuda", 0)] * 2
    assert runtime.choose_device("gloo", "cuda", 3, 4, 2) == torch.device("cuda", 1)


def test_gloo_without_a_device_stays_on_the_cpu_even_with_gpus():
    assert runtime.choose_device("gloo", None, 1, 2, 8) == torch.device("cpu")
    assert runtime.choose_device("gloo", "cpu", 1, 2, 8) == torch.device("cpu")


def test_impossible_combinations_are_refused():
    with pytest.raises(ConfigError, match="device 'cpu' cannot be used with backend 'nccl'"):
        runtime.choose_device("nccl", "cpu", 0, 1, 1)
    with pytest.raises(ConfigError, match="needs a GPU, and none is visible"):
        runtime.choose_device("gloo", "cuda", 0, 1, 0)
    with pytest.raises(ConfigError, match="device must be 'cuda' or 'cpu', got 'tpu'"):
        runtime.choose_device("gloo", "tpu", 0, 1, 0)


def test_backend_defaults():
    assert runtime.choose_backend(None, None, cuda_available=True) == "nccl"
    assert runtime.choose_backend(None, "cpu", cuda_available=True) == "gloo"
    assert runtime.choose_backend(None, None, cuda_available=False) == "gloo"
    assert runtime.choose_backend("gloo", None, cuda_available=True) == "gloo"
    with pytest.raises(ConfigError, match="backend 'nccl' needs CUDA"):
        runtime.choose_backend("nccl", None, cuda_available=False)
    with pytest.raises(ConfigError, match="backend must be 'nccl' or 'gloo', got 'mpi'"):
        runtime.choose_backend("mpi", None, cuda_available=True)


FLIGHT_RECORDER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ENABLE_MONITORING",
                        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_FR_DUMP_TEMP_FILE")


@pytest.fixture
def fake_gpus(monkeypatch):
    """init() on a pretend machine with N GPUs: records what it passes to torch instead of starting a group."""
    calls: dict = {}

    def install(count: int, env: dict[str, str]):
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                    "PMI_RANK", "SLIPSTREAM_BACKEND", "SLIPSTREAM_DEVICE", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        # init() on NCCL sets the flight recorder's variables in os.environ: undone after
        # the test (set then deleted, so monkeypatch restores "absent").
        for key in (*FLIGHT_RECORDER_VARS, "GLOO_SOCKET_IFNAME"):  # init() may set GLOO_SOCKET_IFNAME too
            monkeypatch.setenv(key, "")
            monkeypatch.delenv(key)
        monkeypatch.setattr(gloo_interface, "_GLOO_INTERFACE_NOTE", "")
        monkeypatch.setattr(runtime, "_RUNTIME", None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(runtime, "visible_gpus", lambda: tuple(f"GPU-{i}" for i in range(count)))
        # The GPU-identity exchange after the group starts (a gloo collective): recorded instead.
        monkeypatch.setattr(runtime, "agree_gpu_binding", lambda claim, timeout: calls.__setitem__("claim", claim))
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.__setitem__("set_device", d))
        monkeypatch.setattr(runtime.dist, "is_initialized", lambda: False)
        monkeypatch.setattr(runtime.dist, "init_process_group",
                            lambda backend, **kw: calls.update(backend=backend, **kw))
        monkeypatch.setattr(runtime, "_install_excepthook", lambda: None)
        monkeypatch.setattr(runtime.gloo_exit, "install", lambda: None)
        return calls

    return install


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}


def test_init_nccl_passes_device_id(fake_gpus):
    calls = fake_gpus(2, TORCHRUN)
    rt = runtime.init()
    assert (rt.backend, rt.device) == ("nccl", torch.device("cuda", 1))
    assert calls["device_id"] == torch.device("cuda", 1) and calls["set_device"] == torch.device("cuda", 1)
    # NCCL hangs end in the watchdog's abort: the flight recorder must be on before the group starts.
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(os.environ["TORCH_FR_BUFFER_SIZE"]) > 0


def test_init_refuses_two_nccl_ranks_on_fewer_gpus_than_ranks(fake_gpus):
    calls = fake_gpus(2, {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
                          "CUDA_VISIBLE_DEVICES": "3,4"})
    with pytest.raises(ConfigError, match=r"local rank 1 of 3 on this node but only 2 GPU\(s\) visible "
                                          r"\(CUDA_VISIBLE_DEVICES=3,4\)"):
        runtime.init()
    assert "backend" not in calls  # refused before any process group started


def test_init_gloo_on_cuda_from_the_environment(fake_gpus):
    """SLIPSTREAM_BACKEND/SLIPSTREAM_DEVICE (set by slipstream run --backend/--device) choose without code
    changes; gloo gets no device_id even with CUDA tensors."""
    calls = fake_gpus(1, {**TORCHRUN, "SLIPSTREAM_BACKEND": "gloo", "SLIPSTREAM_DEVICE": "cuda"})
    rt = runtime.init()
    assert (rt.backend, rt.device) == ("gloo", torch.device("cuda", 0))
    assert calls["backend"] == "gloo" and calls["device_id"] is None
    assert calls["set_device"] == torch.device("cuda", 0)


def test_init_gloo_without_a_device_keeps_the_cpu(fake_gpus):
    calls = fake_gpus(4, TORCHRUN)
    rt = runtime.init(backend="gloo")
    assert (rt.backend, rt.device) == ("gloo", torch.device("cpu"))
    assert calls["device_id"] is None and "set_device" not in calls


def test_init_names_a_bad_environment_value(fake_gpus):
    fake_gpus(0, {"SLIPSTREAM_BACKEND": "mpi"})
    with pytest.raises(ConfigError, match="SLIPSTREAM_BACKEND must be one of nccl, gloo, got 'mpi'"):
        runtime.init()


def test_refusal_in_a_script_is_one_line_and_exit_2():
    """A script calling init() that is refused prints one line (no traceback) and exits 2."""
    import os

    code = "import slipstream; slipstream.init(device='cuda')"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, on any machine
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and "needs a GPU, and none is visible" in lines[0], r.stderr
