"""How `slipstream run JOB.yaml` spreads replicas over this machine's GPUs (runner.plan_gpus),
with fake GPU counts: the logic is tested without a GPU."""

from __future__ import annotations

import pytest
import torch

from slipstream.errors import UsageError
from slipstream.job import runner
from slipstream.job.spec import parse_spec

from .conftest import run_cli, write_spec


def _spec(**kw):
    return parse_spec({"name": "a", "image": "i", "command": ["python", "t.py"], **kw})


def test_enough_gpus_give_each_replica_its_own():
    assert runner.plan_gpus(_spec(replicas=2, gpu_count=2), have=4) == (["0,1", "2,3"], None)
    assert runner.plan_gpus(_spec(replicas=2, gpu_count=1), have=3, visible="5,6,7") == (["5", "6"], None)


def test_too_few_gpus_for_nccl_is_refused_with_the_numbers():
    with pytest.raises(UsageError) as err:
        runner.plan_gpus(_spec(replicas=2, gpu_count=2), have=2, visible="0,1")
    text = str(err.value)
    assert "2 GPU(s) here (CUDA_VISIBLE_DEVICES=0,1) for 4 requested (2 replica(s) x gpu_count 2)" in text
    assert "NCCL needs one GPU per process" in text and "--backend gloo --device cuda" in text
    with pytest.raises(UsageError, match="for 2 requested"):
        runner.plan_gpus(_spec(replicas=2, gpu_count=1), have=1, backend="nccl")


def test_gloo_shares_gpus_on_purpose():
    devices, note = runner.plan_gpus(_spec(replicas=2, gpu_count=1), have=1, backend="gloo", device="cuda")
    assert devices == [None, None] and "replicas share them (gloo)" in note
    devices, note = runner.plan_gpus(_spec(replicas=2, gpu_count=1), have=1, backend="gloo")
    assert devices == [None, None] and "gloo runs on the CPU" in note


def test_more_processes_than_gpus_in_a_replica_is_refused_under_nccl():
    # parse_spec refuses this shape already; a spec built in code reaches the runner.
    from dataclasses import replace

    spec = replace(_spec(replicas=1, gpu_count=1), processes_per_replica=2)
    with pytest.raises(UsageError, match="processes_per_replica 2 > gpu_count 1: NCCL needs one GPU per process"):
        runner.plan_gpus(spec, have=8)
    assert runner.plan_gpus(spec, have=8, backend="gloo", device="cuda") == (["0"], None)


def test_no_gpu_here_runs_on_cpu_with_gloo():
    devices, note = runner.plan_gpus(_spec(replicas=2, gpu_count=1), have=0)
    assert devices == [None, None] and note == "no GPU here: running 2 replica(s) x 1 CPU process(es) with gloo"


def test_a_cpu_spec_hides_the_gpus_of_this_machine():
    # Otherwise each replica's rank 0 would default to NCCL on GPU 0, shared: refused by NCCL.
    devices, note = runner.plan_gpus(_spec(replicas=2), have=2)
    assert devices == ["", ""] and "hidden" in note
    assert runner.plan_gpus(_spec(replicas=2), have=0) == ([None, None], None)
    with pytest.raises(UsageError, match="gpu_count is 0 but the workers are asked for GPUs"):
        runner.plan_gpus(_spec(replicas=2), have=2, device="cuda")


def test_the_spec_env_and_the_flags_choose_the_backend(monkeypatch):
    """A job says 'gloo on purpose' in its env (or with slipstream run --backend gloo): the runner plans by it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    spec = _spec(replicas=2, gpu_count=1, env={"SLIPSTREAM_BACKEND": "gloo", "SLIPSTREAM_DEVICE": "cuda"})
    devices, note = runner._gpu_plan(spec, spec.worker_env())
    assert devices == [None, None] and "share" in note
    with pytest.raises(UsageError, match="1 GPU.s. here"):
        runner._gpu_plan(_spec(replicas=2, gpu_count=1), {})
    with pytest.raises(UsageError, match="SLIPSTREAM_BACKEND must be one of nccl, gloo, got 'mpi'"):
        runner._gpu_plan(_spec(replicas=2, gpu_count=1), {"SLIPSTREAM_BACKEND": "mpi"})


def test_backend_and_device_flags_reach_the_workers(capsys):
    from slipstream.cli import build_parser
    from slipstream.launch.cli import worker_env_from_args

    args = build_parser().parse_args(["run", "--backend", "gloo", "--device", "cuda", "j.yaml"])
    env = worker_env_from_args(args)
    assert env["SLIPSTREAM_BACKEND"] == "gloo" and env["SLIPSTREAM_DEVICE"] == "cuda"
    for argv, message in ((["--backend", "mpi"], "--backend must be one of nccl, gloo, got 'mpi'"),
                          (["--device", "tpu"], "--device must be one of cuda, cpu, got 'tpu'"),
                          (["--backend", "nccl", "--device", "cpu"], "--backend nccl cannot run on --device cpu")):
        code, _, err = run_cli(["run", *argv, "train.py"], capsys)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_too_few_gpus_stops_slipstream_run_before_anything_starts(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("SLIPSTREAM_BACKEND", raising=False)
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit('must not start')\n")
    path = write_spec({"name": "a", "image": "i", "command": ["python", str(script)], "replicas": 2, "gpu_count": 1,
                       "restarts": {"max_restarts": 0}}, str(tmp_path))
    code, _, err = run_cli(["run", path], capsys)
    assert code == 2 and "1 GPU(s) here (CUDA_VISIBLE_DEVICES=" in err and "must not start" not in err, err
